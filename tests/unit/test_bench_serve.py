"""bench/serve.py runs against a live gateway (fake engine) and writes its JSON report."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.unit.fakes import forge_serve_fake

pytestmark = pytest.mark.timeout(60)
BENCH = Path(__file__).resolve().parents[2] / "bench" / "serve.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_serve", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


def test_bench_serve_reports_latencies_and_throughput(tmp_path: Path) -> None:
    with forge_serve_fake(max_model_len=4096, step_delay_s=0.002) as config:
        bench = load_bench()
        out = tmp_path / "serve.json"
        args = ["--url", f"http://127.0.0.1:{config.http_port}", "--concurrency", "1,2", "--num-requests", "3",
                "--repeats", "2", "--max-tokens", "8", "--prompt-words", "20", "--out", str(out)]
        assert bench.main(args) == 0
        report = json.loads(out.read_text())
    assert report["model"] == "fake-model" and report["client_machine"]["cores"] >= 1
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    for row in report["results"]:
        assert row["requests"] == 6 and row["errors"] == 0
        assert row["completion_tokens_mean"] == 8 and row["output_tok_s"] > 0
        assert 0 < row["ttft_ms_p50"] <= row["ttft_ms_p99"] and row["itl_ms_p50"] > 0
