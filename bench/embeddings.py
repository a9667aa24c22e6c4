"""Embeddings through the gateway, against the same prompts' prefill as one-token completions, on
one fresh `forge serve` (the default model).

Each client sends --rounds requests of --batch distinct texts of about --words words (no shared
prefix: each text opens with its own number), one request at a time; --clients clients at once.
Reports inputs/s, prompt tokens/s and request latency p50 for /v1/embeddings, then for
/v1/completions with max_tokens 1 on other texts of the same shape (the prompt computed, one
token sampled: an embedding's work, its pooling and normalisation aside), and their ratio.

    python bench/embeddings.py [--clients 4 --batch 16 --words 100 --rounds 4]
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
from bench.serve import discover_model  # noqa: E402

WORDS = ("river stone light garden window morning quiet paper music winter city bridge forest letter "
         "ocean travel market story mountain evening").split()


def texts(numbers: itertools.count, batch: int, words: int) -> list[str]:
    out = []
    for _ in range(batch):
        n = next(numbers)
        out.append(f"{n}. " + " ".join(WORDS[(n * 7 + i * 3) % len(WORDS)] for i in range(words)))
    return out


async def measure(client: httpx.AsyncClient, model: str, route: str, args: argparse.Namespace,
                  numbers: itertools.count) -> dict[str, Any]:
    latencies: list[float] = []
    counts = {"inputs": 0, "tokens": 0}

    async def one_client() -> None:
        for _ in range(args.rounds):
            batch = texts(numbers, args.batch, args.words)
            body: dict[str, Any] = {"model": model, "input": batch} if route == "embeddings" else \
                {"model": model, "prompt": batch, "max_tokens": 1, "temperature": 0.0}
            started = time.perf_counter()
            response = await client.post(f"/v1/{route}", json=body)
            latencies.append(time.perf_counter() - started)
            response.raise_for_status()
            counts["inputs"] += len(batch)
            counts["tokens"] += response.json()["usage"]["prompt_tokens"]

    started = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(args.clients)))
    elapsed = time.perf_counter() - started
    return {"route": route, "inputs_per_s": round(counts["inputs"] / elapsed, 1),
            "prompt_tok_s": round(counts["tokens"] / elapsed, 1),
            "latency_p50_ms": round(1000 * median(latencies), 1), "inputs": counts["inputs"]}


async def run(url: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    numbers = itertools.count()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        model = await discover_model(client)
        await client.post("/v1/embeddings", json={"model": model, "input": texts(numbers, 4, args.words)})  # warm-up
        rows = [await measure(client, model, "embeddings", args, numbers),
                await measure(client, model, "completions", args, numbers)]
    rows[0]["vs_prefill"] = round(rows[0]["prompt_tok_s"] / rows[1]["prompt_tok_s"], 3)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--words", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--serve-args", default="", help="more `forge serve` flags")
    args = parser.parse_args(argv)
    with forge_serve("off", args, free_port()) as url:
        rows = asyncio.run(run(url, args))
    print(table(rows, ["route", "inputs_per_s", "prompt_tok_s", "latency_p50_ms", "inputs", "vs_prefill"]))
    path = write_json("embeddings.json", {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
