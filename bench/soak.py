"""Soak test: a long mixed load against a running gateway, watching for leaks.

`--concurrency` clients send requests back to back for `--duration-s`: chat and completions
(greedy and sampled, n up to 3, logprobs), tool calls, JSON-schema output, embeddings and the
Responses API (`--kinds` picks), 60% of them streamed and one stream in five cut by the client
part-way. Every `--sample-s` it reads the resident memory of the gateway's process (and of the
service's, from `--metrics-url`, where that is another process) and the gauges of work in flight.
At the end it waits for the service to settle and reports:

- the answers by status (any 5xx is a failure);
- resident memory (one figure where the gateway and the service are one process, `forge serve`) at the first and last samples, and its slope in MB per 1,000 requests fitted
  over the second half of the run (after the KV cache's pages and the allocator's pools have
  been touched): a leak shows as a slope that does not fall with a longer run;
- whether, once idle, nothing is left running, waiting, holding a KV block or an open SSE stream.

It exits 1 on a 5xx or a service that does not settle.

    python bench/soak.py --url http://127.0.0.1:8000 --metrics-url http://127.0.0.1:9090/metrics --duration-s 600
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, write_report  # noqa: E402

KINDS = ("chat", "completions", "tools", "json", "embeddings", "responses")
WORDS = ("river stone cloud paper music light garden window forest ocean engine bridge letter "
         "winter silver market").split()
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
          "required": ["name", "count"]}
# The gauges that must read 0 once nothing is in flight (service, gateway).
IN_FLIGHT = ("forge_num_requests_running", "forge_num_requests_waiting", "forge_kv_cache_blocks_used")
STREAMS_OPEN = "forge_gateway_sse_streams_open"


def request(rnd: random.Random, kind: str, model: str) -> tuple[str, dict[str, Any]]:
    """A random request of `kind`: (path, body), the body without `stream`."""
    text = " ".join(rnd.choice(WORDS) for _ in range(rnd.randint(3, 60))) + f" {rnd.random():.6f}"
    max_tokens = rnd.randint(1, 64)
    if kind == "embeddings":
        return "/v1/embeddings", {"model": model, "input": [text, text[::-1]][:rnd.randint(1, 2)]}
    if kind == "completions":
        return "/v1/completions", {"model": model, "prompt": text, "max_tokens": max_tokens, "seed": rnd.randrange(100),
                                   "n": rnd.choice([1, 1, 2]), "logprobs": rnd.choice([None, 2])}
    if kind == "responses":
        return "/v1/responses", {"model": model, "input": text, "max_output_tokens": max(max_tokens, 16)}
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                            "temperature": rnd.choice([0.0, 0.7, 1.2])}
    if kind == "tools":
        body.update(tools=TOOLS, tool_choice=rnd.choice(["auto", "required"]))
    elif kind == "json":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA}}
    else:
        body.update(n=rnd.choice([1, 1, 3]), logprobs=rnd.random() < 0.3)
    return "/v1/chat/completions", body


async def client(number: int, http: httpx.AsyncClient, model: str, kinds: list[str], until: float,
                 answers: Counter) -> None:
    rnd = random.Random(number)
    while time.monotonic() < until:
        path, body = request(rnd, rnd.choice(kinds), model)
        stream = path != "/v1/embeddings" and rnd.random() < 0.6
        try:
            if not stream:
                answers[(await http.post(path, json=body)).status_code] += 1
                continue
            cut_after = rnd.randint(1, 8) if rnd.random() < 0.2 else None
            async with http.stream("POST", path, json={**body, "stream": True}) as response:
                events = 0
                async for line in response.aiter_lines():
                    events += line.startswith("data:")
                    if cut_after is not None and events >= cut_after:
                        break  # the client leaves mid-stream
                answers[response.status_code] += 1
        except httpx.HTTPError as error:
            answers[type(error).__name__] += 1


def gauges(text: str) -> dict[str, float]:
    """Sum of each metric's samples over their labels, from the Prometheus text format."""
    values: Counter = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] += sample.value
    return dict(values)


async def sample(http: httpx.AsyncClient, metrics_url: str | None, done: int, started: float) -> dict[str, float]:
    """Resident memory (MB) of the gateway's and the service's processes and the in-flight gauges."""
    gateway = gauges((await http.get("/metrics")).text)
    service = gauges((await http.get(metrics_url)).text) if metrics_url else {}
    point = {"t_s": round(time.monotonic() - started, 1), "requests": done,
             "gateway_rss_mb": gateway.get("process_resident_memory_bytes", 0.0) / 2 ** 20,
             STREAMS_OPEN: gateway.get(STREAMS_OPEN, 0.0)}
    if service:
        if not _same_process(gateway, service):  # `forge serve` runs both in one
            point["service_rss_mb"] = service.get("process_resident_memory_bytes", 0.0) / 2 ** 20
        point.update({name: service.get(name, 0.0) for name in IN_FLIGHT})
    return point


def _same_process(a: dict[str, float], b: dict[str, float]) -> bool:
    """Started at the same moment with (nearly: read apart) the same address space."""
    start, size = "process_start_time_seconds", "process_virtual_memory_bytes"
    return start in a and a[start] == b.get(start) and abs(a.get(size, 0) - b.get(size, 0)) <= 0.01 * a.get(size, 0)


def slope_per_1000(points: list[dict[str, float]], key: str) -> float | None:
    """Least-squares MB per 1,000 requests over the second half of the samples."""
    half = points[len(points) // 2:]
    if len(half) < 2 or half[-1]["requests"] == half[0]["requests"]:
        return None
    xs, ys = [p["requests"] / 1000 for p in half], [p[key] for p in half]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    kinds = args.kinds.split(",")
    async with httpx.AsyncClient(base_url=args.url, timeout=args.timeout_s) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        answers: Counter = Counter()
        started = time.monotonic()
        until = started + args.duration_s
        clients = [asyncio.create_task(client(i, http, model, kinds, until, answers))
                   for i in range(args.concurrency)]
        points = []
        try:
            while time.monotonic() < until:
                await asyncio.sleep(min(args.sample_s, max(0.0, until - time.monotonic())))
                points.append(await sample(http, args.metrics_url, sum(answers.values()), started))
                print(points[-1], flush=True)
            await asyncio.gather(*clients)
        finally:  # a failed sample ends the run: no client goes on against a closed connection pool
            for task in clients:
                task.cancel()
            await asyncio.gather(*clients, return_exceptions=True)
        settle_by = time.monotonic() + args.settle_s
        while True:  # cut streams' aborts and the last requests take a moment to land
            idle = await sample(http, args.metrics_url, sum(answers.values()), started)
            left = {k: v for k, v in idle.items() if k in (*IN_FLIGHT, STREAMS_OPEN) and v}
            if not left or time.monotonic() > settle_by:
                break
            await asyncio.sleep(0.2)
    memory = [key for key in ("gateway_rss_mb", "service_rss_mb") if key in idle]
    return {"model": model, "duration_s": args.duration_s, "concurrency": args.concurrency, "kinds": kinds,
            "requests": sum(answers.values()), "answers": {str(k): v for k, v in sorted(answers.items(), key=str)},
            "server_errors": sum(v for k, v in answers.items() if isinstance(k, int) and k >= 500),
            "rss_mb": {key: {"first": points[0][key] if points else None, "last": idle[key],
                             "max": max([p[key] for p in points] + [idle[key]]),
                             "slope_mb_per_1000_requests": slope_per_1000(points, key)} for key in memory},
            "settled": not left, "left_in_flight": left, "samples": points, "client_machine": machine()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    parser.add_argument("--metrics-url", default="http://127.0.0.1:9090/metrics",
                        help="the service's /metrics ('' for none)")
    parser.add_argument("--duration-s", type=float, default=600.0)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--sample-s", type=float, default=30.0)
    parser.add_argument("--settle-s", type=float, default=30.0)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    unknown = set(args.kinds.split(",")) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds {sorted(unknown)}; choose from {', '.join(KINDS)}")
    args.metrics_url = args.metrics_url or None
    report = asyncio.run(run(args))
    print({k: v for k, v in report.items() if k not in ("samples", "client_machine")})
    write_report(args.out, "soak", report)
    return 0 if report["settled"] and not report["server_errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
