"""Online serving benchmark: streaming load against the OpenAI gateway.

For each concurrency level (default 1, 4, 16, 32, 64), `concurrency` clients send streaming
requests back to back until --num-requests are done. With --repeats N the levels run in turn N
times, forwards then backwards (1, 4, ..., 64, then 64, ..., 4, 1, ...), so that a drift of the
machine within the run falls on every level alike and a steady one cancels over two rounds. Reported: TTFT and inter-token latency (ITL: gaps between content chunks) p50/p99
over all requests of all repeats, TPOT p50 ((latency - TTFT) / (tokens - 1)), output tokens/s
(median over repeats), its ratio to the level before (the median over repeats of each round's
ratio: two runs minutes apart, not hours), and errors. Prints a table, writes JSON, and records
the machine the client ran on.

Each prompt is its own: about --prompt-words words drawn from a fixed vocabulary in an order
seeded by the request's number, so prompts share no prefix beyond the chat template and
prefix caching cannot skip their prefill (--same-prompt sends one prompt to all). A large
--prompt-words makes a prefill-heavy load (880 words: about 1,000 tokens with the default model).

    python bench/serve.py --url http://127.0.0.1:8000 --endpoint chat --max-tokens 128
    python bench/serve.py --endpoint chat --prompt-words 880 --concurrency 8 --num-requests 16 --max-tokens 64
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, write_report  # noqa: E402

# The words every prompt is drawn from (model-independent); token counts come back in usage.prompt_tokens.
BASE_PROMPT = ("The history of the printing press begins in the fifteenth century, when movable type "
               "changed how knowledge spread across Europe. ")


@dataclass
class Sample:
    ok: bool
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""


def request_bodies(args: argparse.Namespace, model: str) -> tuple[str, Callable[[], dict[str, Any]]]:
    """The endpoint, and a function giving each request's body. Unless --same-prompt, every
    prompt starts with its own request number, so no request reuses another's KV cache."""
    vocabulary = BASE_PROMPT.split()
    common = {"model": model, "max_tokens": args.max_tokens, "stream": True, "temperature": 0.0,
              "ignore_eos": True, "stream_options": {"include_usage": True}}
    numbers = itertools.count()

    def words(seed: int) -> list[str]:
        pick = random.Random(seed)
        return [pick.choice(vocabulary) for _ in range(args.prompt_words)]

    def body() -> dict[str, Any]:
        n = next(numbers)
        prompt = " ".join(words(0)) if args.same_prompt else f"Request {n}. " + " ".join(words(n))
        if args.endpoint == "chat":
            return {**common, "messages": [{"role": "user", "content": prompt}]}
        return {**common, "prompt": prompt}

    return ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions"), body


def _content(event: dict[str, Any]) -> str:
    text = ""
    for choice in event.get("choices", []):
        text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    return text


async def one_request(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> Sample:
    start = time.perf_counter()
    sample, last = Sample(ok=False), None
    try:
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                return Sample(ok=False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Sample(ok=False, error=event["error"].get("message", "stream error"))
                now = time.perf_counter()
                if _content(event):
                    if last is None:
                        sample.ttft_s = now - start
                    else:
                        sample.itl_s.append(now - last)
                    last = now
                if event.get("usage"):
                    sample.prompt_tokens = event["usage"]["prompt_tokens"]
                    sample.completion_tokens = event["usage"]["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        return Sample(ok=False, error=f"{type(error).__name__}: {error}")
    sample.latency_s = time.perf_counter() - start
    sample.ok = last is not None
    if not sample.ok:
        sample.error = "no content in the stream"
    return sample


async def one_run(client: httpx.AsyncClient, path: str, body: Callable[[], dict[str, Any]], concurrency: int,
                  num_requests: int) -> tuple[list[Sample], float]:
    remaining = iter(range(num_requests))
    samples: list[Sample] = []

    async def worker() -> None:
        for _ in remaining:
            samples.append(await one_request(client, path, body()))

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return samples, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q
    low, high = int(rank), min(int(rank) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def summarize(concurrency: int, runs: list[tuple[list[Sample], float]]) -> dict[str, Any]:
    samples = [s for run, _ in runs for s in run]
    good = [s for s in samples if s.ok]
    ttft = [s.ttft_s for s in good]
    itl = [gap for s in good for gap in s.itl_s]
    tpot = [(s.latency_s - s.ttft_s) / (s.completion_tokens - 1) for s in good if s.completion_tokens > 1]
    throughput = [sum(s.completion_tokens for s in run if s.ok) / wall for run, wall in runs]
    return {
        "concurrency": concurrency, "requests": len(samples), "errors": len(samples) - len(good),
        "error_examples": sorted({s.error for s in samples if not s.ok})[:3],
        "ttft_ms_p50": ms(percentile(ttft, 0.5)), "ttft_ms_p99": ms(percentile(ttft, 0.99)),
        "itl_ms_p50": ms(percentile(itl, 0.5)), "itl_ms_p99": ms(percentile(itl, 0.99)),
        "tpot_ms_p50": ms(percentile(tpot, 0.5)),
        "output_tok_s": round(statistics.median(throughput), 1) if throughput else 0.0,
        "output_tok_s_runs": [round(t, 1) for t in throughput],
        "prompt_tokens": good[0].prompt_tokens if good else None,
        "completion_tokens_mean": round(statistics.fmean(s.completion_tokens for s in good), 1) if good else None,
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Each row's `x_previous`: the median over repeats of its throughput over the row before's in the
    same round (None for the first row, or where a run had no throughput)."""
    rows[0]["x_previous"] = None
    for before, row in zip(rows, rows[1:]):
        pairs = [now / then for now, then in zip(row["output_tok_s_runs"], before["output_tok_s_runs"]) if then > 0]
        row["x_previous"] = round(statistics.median(pairs), 3) if pairs else None


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = [("conc", "concurrency"), ("reqs", "requests"), ("err", "errors"), ("TTFT p50 ms", "ttft_ms_p50"),
               ("TTFT p99 ms", "ttft_ms_p99"), ("ITL p50 ms", "itl_ms_p50"), ("ITL p99 ms", "itl_ms_p99"),
               ("TPOT p50 ms", "tpot_ms_p50"), ("out tok/s", "output_tok_s"), ("x previous", "x_previous")]
    print("  ".join(f"{title:>11}" for title, _ in columns))
    for row in rows:
        print("  ".join(f"{'-' if row[key] is None else row[key]:>11}" for _, key in columns))
        for example in row["error_examples"]:
            print(f"    error: {example}")


async def discover_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=args.timeout_s, limits=limits) as client:
        model = args.model or await discover_model(client)
        path, body = request_bodies(args, model)
        for _ in range(args.warmup):
            await one_request(client, path, body())
        runs: list[list[tuple[list[Sample], float]]] = [[] for _ in args.concurrency]  # a level may repeat
        for round_ in range(args.repeats):
            levels = list(enumerate(args.concurrency))
            for level, concurrency in levels if round_ % 2 == 0 else reversed(levels):
                num_requests = args.num_requests or max(4 * concurrency, 8)
                runs[level].append(await one_run(client, path, body, concurrency, num_requests))
        rows = [summarize(concurrency, level_runs) for concurrency, level_runs in zip(args.concurrency, runs)]
        add_ratios(rows)
    return {"benchmark": "serve", "url": args.url, "endpoint": path, "model": model,
            "max_tokens": args.max_tokens, "prompt_words": args.prompt_words, "same_prompt": args.same_prompt,
            "repeats": args.repeats,
            "client_machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "results": rows}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("FORGE_API_KEY"))
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 32, 64])
    parser.add_argument("--num-requests", type=int, default=0, help="per run (default: 4 x concurrency, >= 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=128)
    parser.add_argument("--same-prompt", action="store_true",
                        help="send one prompt to every request (prefix caching then skips most prefill)")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--out", type=Path, default=None, help="JSON path (default: bench/results/serve-<time>.json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(bench(args))
    m = report["client_machine"]
    print(f"serve bench: {report['model']} via {report['url']}{report['endpoint']}, max_tokens={args.max_tokens}, "
          f"{args.repeats} repeats; client: {m['cpu']}, {m['cores']} cores")
    print_table(report["results"])
    write_report(args.out, "serve", report)
    return 1 if any(row["errors"] for row in report["results"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
