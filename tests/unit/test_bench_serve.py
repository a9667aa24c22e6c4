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


def test_bench_serve_runs_the_levels_in_turn_and_pairs_each_with_the_one_before(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """--repeats runs 1, 2, 4, 4, 2, 1, 1, 2, 4 (not each level's repeats back to back), and a level's
    ratio to the one before is the median of the rounds' own ratios: here the machine halves its speed
    after the first round, so the levels' medians (50 / 80 / 90 tok/s) would give 1.6 and 1.125, the
    rounds' own ratios 1.5 and 1.267."""
    with forge_serve_fake(max_model_len=4096, step_delay_s=0.002) as config:
        bench = load_bench()
        calls = []
        # tokens a second per round and level: round 0 fast, rounds 1 and 2 at half speed
        speed = {(0, 1): 100.0, (0, 2): 150.0, (0, 4): 190.0, (1, 1): 50.0, (1, 2): 60.0, (1, 4): 90.0,
                 (2, 1): 50.0, (2, 2): 80.0, (2, 4): 70.0}

        async def fake_run(client, path, body, concurrency, num_requests):
            round_ = sum(1 for c in calls if c == concurrency)
            calls.append(concurrency)
            sample = bench.Sample(ok=True, ttft_s=0.01, latency_s=0.1, itl_s=[0.01], completion_tokens=10)
            return [sample], 10 / speed[round_, concurrency]

        monkeypatch.setattr(bench, "one_run", fake_run)
        out = tmp_path / "serve.json"
        args = ["--url", f"http://127.0.0.1:{config.http_port}", "--concurrency", "1,2,4", "--repeats", "3",
                "--warmup", "0", "--out", str(out)]
        assert bench.main(args) == 0
        report = json.loads(out.read_text())
    assert calls == [1, 2, 4, 4, 2, 1, 1, 2, 4]
    rows = report["results"]
    assert [r["output_tok_s"] for r in rows] == [50.0, 80.0, 90.0]
    assert rows[0]["x_previous"] is None
    assert rows[1]["x_previous"] == 1.5  # rounds: 1.5, 1.2, 1.6
    assert rows[2]["x_previous"] == pytest.approx(1.267, abs=1e-3)  # 1.267, 1.5, 0.875

    calls.clear()  # a level named twice is two rows, each with its own runs
    with forge_serve_fake(max_model_len=4096, step_delay_s=0.002) as config:
        args[1] = f"http://127.0.0.1:{config.http_port}"
        args[3], args[5] = "1,1", "1"
        assert bench.main(args) == 0
        rows = json.loads(out.read_text())["results"]
    assert calls == [1, 1] and [(r["requests"], r["output_tok_s"], r["x_previous"]) for r in rows] == [
        (1, 100.0, None), (1, 50.0, 0.5)]
