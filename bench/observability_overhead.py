"""What metrics and tracing cost: streaming throughput of one build in three set-ups, one run.

    off      `forge serve --metrics-port 0`: no engine metrics (the gateway still counts requests)
    metrics  `forge serve` with the service's /metrics on (the default), tracing off
    tracing  metrics on, and every request traced to an OTLP/gRPC receiver in this process

Each set-up gets its own `forge serve` (started in turn, never two at once), a warm-up, then
--repeats runs of --num-requests streaming requests at --concurrency (bench/serve.py's client);
the set-ups are visited round-robin --rounds times, so slow drift of a shared machine falls on
all three alike. Reported: median output tok/s and its ratio to `off`, TTFT/ITL p50, and the
spans the receiver got. Targets: metrics < 2% and tracing < 5% below `off`.

    python bench/observability_overhead.py --concurrency 16 --rounds 2 --repeats 3
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import grpc
import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import serve as load  # noqa: E402
from bench.common import machine, write_report  # noqa: E402

SETUPS = ("off", "metrics", "tracing")


class SpanCounter:
    """An OTLP/gRPC trace receiver that only counts what it is sent."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        self.count = 0
        self._lock = threading.Lock()
        self._response = trace_service_pb2.ExportTraceServiceResponse
        servicer = type("Servicer", (trace_service_pb2_grpc.TraceServiceServicer,), {"Export": self._export})()
        self.server = grpc.server(ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def _export(self, request: Any, context: Any) -> Any:
        with self._lock:
            self.count += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
        return self._response()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def forge_serve(setup: str, args: argparse.Namespace, receiver_port: int) -> Iterator[str]:
    """`forge serve` for one set-up on free ports; yields the gateway URL once it answers."""
    http_port = free_port()
    argv = [str(Path(sys.executable).parent / "forge"), "serve", "--grpc-port", str(free_port()),
            "--http-port", str(http_port), "--metrics-port", "0" if setup == "off" else str(free_port()),
            "--log-level", "warning", *args.serve_args.split()]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FORGE_", "OTEL_"))}
    if setup == "tracing":
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{receiver_port}"
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{http_port}"
    try:
        deadline = time.monotonic() + 300
        while not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"forge serve ({setup}) did not start:\n{log.read()[-3000:].decode()}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


async def measure(url: str, args: argparse.Namespace) -> list[tuple[list[load.Sample], float]]:
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout_s, limits=limits) as client:
        model = await load.discover_model(client)
        path, body = load.request_bodies(args, model)
        for _ in range(args.warmup):
            await load.one_request(client, path, body())
        return [await load.one_run(client, path, body, args.concurrency, args.num_requests)
                for _ in range(args.repeats)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    receiver = SpanCounter()
    runs: dict[str, list[tuple[list[load.Sample], float]]] = {s: [] for s in SETUPS}
    spans: dict[str, int] = {s: 0 for s in SETUPS}
    for _ in range(args.rounds):
        for setup in SETUPS:
            with forge_serve(setup, args, receiver.port) as url:
                before = receiver.count  # after the readiness polls, which are traced too
                runs[setup] += asyncio.run(measure(url, args))
            time.sleep(1.0)  # the exporter flushes at exit
            spans[setup] += receiver.count - before
    receiver.server.stop(None)
    rows = []
    baseline = None
    for setup in SETUPS:
        row = {"setup": setup, **load.summarize(args.concurrency, runs[setup]), "spans_received": spans[setup]}
        baseline = baseline or row["output_tok_s"]
        row["vs_off"] = round(row["output_tok_s"] / baseline, 4) if baseline else None
        rows.append(row)
    return {"benchmark": "observability_overhead", "concurrency": args.concurrency, "rounds": args.rounds,
            "repeats": args.repeats, "num_requests": args.num_requests, "max_tokens": args.max_tokens,
            "serve_args": args.serve_args, "machine": machine(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "results": rows}


def print_table(report: dict[str, Any]) -> None:
    print(f"{'set-up':>8}  {'out tok/s':>9}  {'vs off':>7}  {'TTFT p50 ms':>11}  {'ITL p50 ms':>10}  "
          f"{'errors':>6}  {'spans':>6}")
    for row in report["results"]:
        print(f"{row['setup']:>8}  {row['output_tok_s']:>9}  {row['vs_off']!s:>7}  {row['ttft_ms_p50']!s:>11}  "
              f"{row['itl_ms_p50']!s:>10}  {row['errors']:>6}  {row['spans_received']:>6}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64, help="per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per set-up and round")
    parser.add_argument("--rounds", type=int, default=2, help="times each set-up is started and measured")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-words", type=int, default=128)
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--same-prompt", action="store_true")
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--serve-args", default="", help="more `forge serve` flags, e.g. '--num-threads 2'")
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    m = report["machine"]
    print(f"observability overhead: c={args.concurrency}, {args.rounds} rounds x {args.repeats} runs of "
          f"{args.num_requests} requests x {args.max_tokens} tokens; {m['cpu']}, {m['cores']} cores")
    print_table(report)
    write_report(args.out, "observability", report)
    return 1 if any(row["errors"] for row in report["results"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
