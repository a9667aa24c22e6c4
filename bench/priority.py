"""Interactive requests beside a batch job on one saturated server: first-come-first-served
against priority scheduling.

A batch job keeps --batch-streams long streams running (priority 1 under the priority policy);
interactive chat requests (priority 0) arrive one at a time, --gap-s apart. With more batch streams
than --max-num-seqs seats, an interactive request under fcfs queues behind the batch; under
priority it takes a batch stream's seat (that stream is preempted and recomputed later). Reports
the interactive requests' TTFT and latency and the batch job's tokens per second (its completed
requests' tokens over the whole run), per policy, each on its own fresh `forge serve`.

    python bench/priority.py [--max-num-seqs 8 --batch-streams 16 --interactive 12]
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, median, table, write_json  # noqa: E402
from bench.observability_overhead import forge_serve, free_port  # noqa: E402
from bench.serve import Sample, discover_model, one_request, percentile  # noqa: E402


def _body(model: str, n: int, max_tokens: int, priority: int) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": f"Request {n}. Tell me about rivers."}],
            "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **({"priority": priority} if priority else {})}


async def measure(url: str, args: argparse.Namespace, policy: str) -> dict[str, Any]:
    numbers = itertools.count()
    low = 1 if policy == "priority" else 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = await discover_model(client)
        stop = asyncio.Event()
        batch: list[Sample] = []

        async def batch_stream() -> None:
            while not stop.is_set():
                batch.append(await one_request(client, "/v1/chat/completions",
                                               _body(model, next(numbers), args.batch_tokens, low)))

        started = time.perf_counter()
        streams = [asyncio.create_task(batch_stream()) for _ in range(args.batch_streams)]
        await asyncio.sleep(args.warmup_s)  # the batch fills every seat first
        interactive = []
        for _ in range(args.interactive):
            interactive.append(await one_request(client, "/v1/chat/completions",
                                                 _body(model, next(numbers), args.interactive_tokens, 0)))
            await asyncio.sleep(args.gap_s)
        stop.set()
        await asyncio.gather(*streams)  # each batch stream ends its request in flight
        elapsed = time.perf_counter() - started
    failed = [s.error for s in interactive + batch if not s.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    ttft = [s.ttft_s for s in interactive]
    done = [s for s in batch if s.ok]
    return {"policy": policy, "interactive_ttft_p50_ms": round(1000 * median(ttft), 1),
            "interactive_ttft_p90_ms": round(1000 * (percentile(ttft, 0.9) or 0), 1),
            "interactive_latency_p50_ms": round(1000 * median([s.latency_s for s in interactive]), 1),
            "batch_tok_s": round(sum(s.completion_tokens for s in done) / elapsed, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--batch-streams", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=256)
    parser.add_argument("--interactive", type=int, default=12)
    parser.add_argument("--interactive-tokens", type=int, default=16)
    parser.add_argument("--gap-s", type=float, default=0.5)
    parser.add_argument("--warmup-s", type=float, default=5.0)
    parser.add_argument("--policies", type=lambda s: s.split(","), default=["fcfs", "priority"])
    args = parser.parse_args(argv)
    rows = []
    for policy in args.policies:
        args.serve_args = f"--scheduling-policy {policy} --max-num-seqs {args.max_num_seqs}"
        with forge_serve("off", args, free_port()) as url:
            rows.append(asyncio.run(measure(url, args, policy)))
        print(table(rows[-1:], list(rows[-1])), flush=True)
    print(table(rows, list(rows[0])))
    path = write_json("priority.json", {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
