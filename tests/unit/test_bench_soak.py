"""bench/soak.py against a live service and gateway (fake engine): it counts the answers, samples
memory and the in-flight gauges, and fails a service whose gauges do not settle."""
from __future__ import annotations

import http.server
import importlib.util
import json
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.unit.fakes import forge_serve_fake

pytestmark = pytest.mark.timeout(60)
BENCH = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_soak", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


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
    with forge_serve_fake(max_model_len=4096, step_delay_s=0.002) as config:
        code = bench.main(["--url", f"http://127.0.0.1:{config.http_port}", "--metrics-url",
                           f"http://127.0.0.1:{config.metrics_port}/metrics", "--duration-s", "2", "--sample-s", "0.5",
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
    with forge_serve_fake(max_model_len=4096, step_delay_s=0.002) as config, stuck_metrics() as metrics_url:
        code = bench.main(["--url", f"http://127.0.0.1:{config.http_port}", "--metrics-url", metrics_url, "--duration-s", "0.5",
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
