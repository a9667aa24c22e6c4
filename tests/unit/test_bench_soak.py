"""bench/soak.py against a live service and gateway (fake engine): it counts the answers, samples
memory and the in-flight gauges, and fails a service whose gauges do not settle."""
from __future__ import annotations

import asyncio
import http.server
import importlib.util
import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from forge_service.config import ServiceConfig
from forge_service.metrics import metrics_endpoint
from forge_service.serve import run_all_async
from forge_service.server import ForgeService
from tests.ports import free_port
from tests.unit.fakes import FakeEngine, wait_ready

pytestmark = pytest.mark.timeout(60)
BENCH = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_soak", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@contextmanager
def forge_serve() -> Iterator[tuple[int, int]]:
    """The service and gateway in one process, as `forge serve` runs them: (HTTP port, metrics port)."""
    config = ServiceConfig(host="127.0.0.1", grpc_port=0, http_port=free_port(), metrics_port=free_port(),
                           drain_timeout_s=1)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    service = ForgeService(config, lambda: FakeEngine(max_model_len=4096, step_delay_s=0.002))
    thread = threading.Thread(target=loop.run_until_complete, args=(run_all_async(service, config, stop),))
    with metrics_endpoint(service.metrics.registry, config.host, config.metrics_port):
        thread.start()
        try:
            wait_ready(f"http://127.0.0.1:{config.http_port}")
            yield config.http_port, config.metrics_port
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(20)
            loop.close()


@contextmanager
def stuck_metrics() -> Iterator[str]:
    """A /metrics that always has a request running and a block held."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b'forge_num_requests_running{model_name="m"} 1.0\nforge_kv_cache_blocks_used{model_name="m"} 3.0\n'
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/metrics"
    finally:
        server.shutdown()
        server.server_close()


def test_soak_counts_answers_samples_memory_and_sees_the_service_settle(tmp_path: Path) -> None:
    bench = load_bench()
    out = tmp_path / "soak.json"
    with forge_serve() as (port, metrics_port):
        code = bench.main(["--url", f"http://127.0.0.1:{port}", "--metrics-url",
                           f"http://127.0.0.1:{metrics_port}/metrics", "--duration-s", "2", "--sample-s", "0.5",
                           "--concurrency", "4", "--kinds", "chat,completions", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["settled"] and report["left_in_flight"] == {}
    assert report["requests"] > 10 and set(report["answers"]) == {"200"} and report["server_errors"] == 0
    assert len(report["samples"]) >= 3
    for point in report["samples"]:
        assert set(bench.IN_FLIGHT) <= set(point) and point["gateway_rss_mb"] > 10
    # one process: its memory once, not twice
    assert set(report["rss_mb"]) == {"gateway_rss_mb"}
    assert report["rss_mb"]["gateway_rss_mb"]["slope_mb_per_1000_requests"] is not None


def test_soak_fails_a_service_that_keeps_work_in_flight(tmp_path: Path) -> None:
    bench = load_bench()
    with forge_serve() as (port, _), stuck_metrics() as metrics_url:
        code = bench.main(["--url", f"http://127.0.0.1:{port}", "--metrics-url", metrics_url, "--duration-s", "0.5",
                           "--sample-s", "0.25", "--settle-s", "0.5", "--concurrency", "2", "--kinds", "chat",
                           "--out", str(tmp_path / "soak.json")])
    report = json.loads((tmp_path / "soak.json").read_text())
    assert code == 1 and not report["settled"]
    assert report["left_in_flight"] == {"forge_num_requests_running": 1.0, "forge_kv_cache_blocks_used": 3.0}
    # another process's memory is reported beside the gateway's
    assert set(report["rss_mb"]) == {"gateway_rss_mb", "service_rss_mb"}


def test_slope_is_fitted_over_the_second_half() -> None:
    bench = load_bench()
    points = [{"requests": r, "rss": 100.0 + (0 if r < 2000 else 5 * (r - 2000) / 1000)} for r in range(0, 4001, 500)]
    assert bench.slope_per_1000(points, "rss") == pytest.approx(5.0)  # the warm-up's flat start is left out
    assert bench.slope_per_1000(points[:1], "rss") is None
    assert bench.gauges('a{x="1"} 2.0\na{x="2"} 3.0\n# HELP b\nb 1e3\n') == {"a": 5.0, "b": 1000.0}
