"""Structured-output overhead: mean decode-step time with and without a JSON Schema constraint.

At batch 1 and batch 16, B chat requests decode `--steps` tokens together on the default model,
unconstrained (ignore_eos) in one engine and with every row under a JSON Schema in a second
engine over the same weights. The schema's documents are far longer than `--steps`, so no row
ends early and both batches keep the same shape. The two engines step alternately, so load from
other processes on a shared machine falls on both alike; only steps where every row decodes are
timed. Each number is the median over `--rounds` runs of that run's mean (and median) step
time; the overhead is the ratio of the two. The mask's own costs (filling the packed bitmask
in llguidance, applying it to the logits) are timed inside the constrained steps.

Usage: python bench/structured_overhead.py [--rounds 5] [--steps 48] [--batch 1 16] [--dtype auto] [--num-threads 1]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, median, table, write_json  # noqa: E402

# 24+ objects of 4 fields: several hundred tokens before the grammar may end.
SCHEMA = {
    "type": "array", "minItems": 24,
    "items": {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "email", "tags"], "additionalProperties": False},
}
PROMPT = [{"role": "user", "content": "List the people in my address book as JSON."}]


class Timer:
    """Wraps a function and adds up the seconds spent in it."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def add_requests(engine: Any, tag: str, batch: int, steps: int, constraint: Any) -> None:
    from forge_service import SamplingParams

    params = SamplingParams(temperature=0.7, max_tokens=steps + 1, ignore_eos=True, constraint=constraint)
    prompt = engine.tokenizer.encode_chat(PROMPT)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", prompt, dataclasses.replace(params, seed=i))


def all_decoding(engine: Any, batch: int) -> bool:
    """Whether the next step computes exactly one token for each of `batch` running rows."""
    running = engine.scheduler.running
    return len(running) == batch and all(r.num_computed_tokens == r.num_tokens - 1 for r in running)


def timed_step(engine: Any, batch: int, times: list[float], texts: dict[str, str]) -> None:
    decoding = all_decoding(engine, batch)
    start = time.perf_counter()
    outputs = engine.step()
    if decoding:
        times.append(time.perf_counter() - start)
    for o in outputs:
        for c in o.outputs:
            assert c.finish_reason in (None, "length")
            texts[o.request_id] = texts.get(o.request_id, "") + c.text


def run(free: Any, masked: Any, batch: int, steps: int, tag: str) -> dict[str, float]:
    """One paired run: both engines decode `steps` tokens for `batch` rows, stepping alternately."""
    from forge_service.sampling import sampler
    from forge_service.structured import Constraint

    add_requests(free.engine, f"free-{tag}", batch, steps, None)
    add_requests(masked.engine, f"masked-{tag}", batch, steps, Constraint("json_schema", json.dumps(SCHEMA)))
    grammars = masked.engine.runner.grammars
    fill, apply = Timer(grammars.bitmask), Timer(sampler.apply_token_bitmask)
    grammars.bitmask, sampler.apply_token_bitmask = fill, apply  # the free engine only passes None masks
    times: dict[str, list[float]] = {"free": [], "masked": []}
    texts: dict[str, str] = {}
    try:
        while free.engine.has_unfinished_requests() or masked.engine.has_unfinished_requests():
            if free.engine.has_unfinished_requests():
                timed_step(free.engine, batch, times["free"], {})
            if masked.engine.has_unfinished_requests():
                timed_step(masked.engine, batch, times["masked"], texts)
    finally:
        del grammars.bitmask
        sampler.apply_token_bitmask = apply.fn
    head = '[{"name": "'  # every constrained output starts so (or is a prefix of it)
    assert len(texts) == batch and all(t[:len(head)] == head[:len(t)] for t in texts.values()), texts
    n = len(times["masked"])  # prefill steps' mask costs are tiny and included
    return {"free_mean_ms": 1e3 * sum(times["free"]) / len(times["free"]),
            "masked_mean_ms": 1e3 * sum(times["masked"]) / n,
            "free_median_ms": 1e3 * median(times["free"]), "masked_median_ms": 1e3 * median(times["masked"]),
            "steps": n, "fill_ms": 1e3 * fill.seconds / n, "apply_ms": 1e3 * apply.seconds / n}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--dtype", default="auto")
    # One thread: on a shared machine, OpenMP threads that outnumber the free cores make step times swing ten-fold.
    p.add_argument("--num-threads", type=int, default=1, help="torch threads; 0 keeps torch's default")
    args = p.parse_args()

    import torch

    from forge_service import LLM

    engines = [LLM(dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=max(args.batch),
                   kv_cache_bytes=256 << 20) for _ in range(2)]
    run(*engines, 2, 4, "warm-up")  # compiles the grammar (cached from here on), builds llguidance's index
    rows = []
    for batch in args.batch:
        runs = [run(*engines, batch, args.steps, f"{batch}-{r}") for r in range(args.rounds)]
        row = {k: median([r[k] for r in runs]) for k in runs[0]}
        row["overhead_mean_pct"] = 100 * (row["masked_mean_ms"] / row["free_mean_ms"] - 1)
        row["overhead_median_pct"] = 100 * (row["masked_median_ms"] / row["free_median_ms"] - 1)
        row["mask_pct"] = 100 * (row["fill_ms"] + row["apply_ms"]) / row["free_median_ms"]
        rows.append({"batch": batch, **row, "runs": runs})
    llm = engines[1]
    info = {**machine(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "dtype": str(llm.engine.dtype), "model": llm.engine.model_name}
    print(f"machine: {info}")
    print(f"workload: batch x {args.steps} decode steps, temperature 0.7, every row under one JSON Schema "
          f"(or none); median over {args.rounds} paired runs")
    print(table(rows, ["batch", "free_mean_ms", "masked_mean_ms", "overhead_mean_pct", "free_median_ms",
                       "masked_median_ms", "overhead_median_pct", "fill_ms", "apply_ms", "mask_pct"]))
    path = write_json("structured_overhead.json", {"machine": info, "args": vars(args), "schema": SCHEMA,
                                                   "results": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
