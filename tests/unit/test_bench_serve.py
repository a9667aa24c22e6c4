"""bench/serve.py runs against a live gateway (fake engine) and writes its JSON report."""
from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import threading
from pathlib import Path

import pytest

from forge_service.config import ServiceConfig
from forge_service.serve import run_all_async
from forge_service.server import ForgeService
from tests.ports import free_port
from tests.unit.fakes import FakeEngine, wait_ready

pytestmark = pytest.mark.timeout(60)
BENCH = Path(__file__).resolve().parents[2] / "bench" / "serve.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_bench_serve_reports_latencies_and_throughput(tmp_path: Path) -> None:
    port = free_port()
    config = ServiceConfig(host="127.0.0.1", grpc_port=0, http_port=port, drain_timeout_s=1)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    service = ForgeService(config, lambda: FakeEngine(max_model_len=4096, step_delay_s=0.002))
    thread = threading.Thread(target=loop.run_until_complete, args=(run_all_async(service, config, stop),))
    thread.start()
    try:
        bench = load_bench()
        out = tmp_path / "serve.json"
        args = ["--url", f"http://127.0.0.1:{port}", "--concurrency", "1,2", "--num-requests", "3",
                "--repeats", "2", "--max-tokens", "8", "--prompt-words", "20", "--out", str(out)]
        wait_ready(f"http://127.0.0.1:{port}")
        assert bench.main(args) == 0
        report = json.loads(out.read_text())
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(20)
        loop.close()
    assert report["model"] == "fake-model" and report["client_machine"]["cores"] >= 1
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["requests"] == 6 and row["errors"] == 0
        assert row["completion_tokens_mean"] == 8 and row["output_tok_s"] > 0
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"] and row["itl_ms_p50"] > 0
