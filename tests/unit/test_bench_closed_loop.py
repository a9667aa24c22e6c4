"""bench/closed_loop.py on the tiny model: every request's tokens come back, and the step log counts
each step's decode rows (drafted ones included) and prefill tokens as the scheduler made them."""
from __future__ import annotations

import asyncio

from bench.closed_loop import bench, parse_args
from tests.unit.test_engine_tiny import tiny_dir  # noqa: F401 (a fixture: the sharp tiny model)


def run(tiny_dir, tmp_path, *flags: str) -> list[dict]:
    args = parse_args(["--model", str(tiny_dir), "--num-requests", "5", "--max-tokens", "6", "--prompt-words", "4",
                       "--out", str(tmp_path / "report.json"), *flags])
    return asyncio.run(bench(args))["results"]


def test_the_closed_loop_gets_every_token_and_logs_each_step_s_rows(tiny_dir, tmp_path):
    one, three = run(tiny_dir, tmp_path, "--concurrency", "1,3", "--speculative", "off")
    for row in (one, three):
        assert (row["requests"], row["output_tokens"]) == (5, 30)
        # a request's first token comes with its prompt's last chunk, the other five from decodes
        assert row["decode_rows"] == 5 * 5
        assert row["prefill_tokens"] > 0 and 0 < row["prefill_step_share"] <= 1 and row["ttft_ms_p50"] > 0
    # one stream at a time: each request is one prefill step (its prompt fits one) and five decodes
    assert one["steps"] == 5 * 6 and one["decode_rows_mean"] == 1
    assert three["steps"] < one["steps"] and 1 < three["decode_rows_mean"] <= 3


def test_a_drafted_decode_counts_a_row_for_each_token_it_verifies(tiny_dir, tmp_path):
    (row,) = run(tiny_dir, tmp_path, "--concurrency", "1", "--max-tokens", "24", "--speculative", "ngram")
    assert row["output_tokens"] == 5 * 24 and row["drafted"] > 0
    # each decode verifies its last token and its draft, and gets that token and the accepted drafts
    assert row["decode_rows"] == 5 * 23 - row["accepted"] + row["drafted"]
