"""Memory of a service replica and of the gateway, idle and under load: what the Helm chart's
resource requests and limits are sized from.

Starts `python -m forge_service` (default model, the given KV cache) and `python -m forge_gateway`
on loopback ports, samples each process's resident memory (RSS, children included) while it loads,
while idle, and while `--concurrency` streams of `--max-tokens` run, and prints the peaks.

    .venv/bin/python bench/memory.py                       # default KV cache (1 GiB)
    .venv/bin/python bench/memory.py --kv-cache-bytes 268435456 --concurrency 4 --max-tokens 32
"""
from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import chat_prompts, machine, table, write_json  # noqa: E402

MIB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Peak:
    """The largest RSS (process and children) seen by a sampling thread, per phase."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.phase = "loading"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        try:
            return sum(p.memory_info().rss for p in [self.process, *self.process.children(recursive=True)])
        except psutil.NoSuchProcess:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), self.rss())

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def start(argv: list[str], log: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"a server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("not ready in time")


async def load(url: str, concurrency: int, max_tokens: int, model: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(messages: list[dict[str, str]]) -> None:
            body = {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True}
            response = await client.post("/v1/chat/completions", json=body)
            response.raise_for_status()

        await asyncio.gather(*(one(m) for m in chat_prompts(concurrency)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache-bytes", type=int, default=None, help="service KV cache (default: Forge's)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="load rounds (the peak is over all)")
    args = parser.parse_args()

    grpc_port, http_port = free_port(), free_port()
    logs = Path(tempfile.mkdtemp(prefix="forge-memory-"))
    service_argv = [sys.executable, "-m", "forge_service", "--grpc-port", str(grpc_port), "--log-level", "warning"]
    if args.kv_cache_bytes:
        service_argv += ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    service = start(service_argv, logs / "service.log")
    gateway = start([sys.executable, "-m", "forge_gateway", "--target", f"127.0.0.1:{grpc_port}",
                     "--port", str(http_port), "--log-level", "warning"], logs / "gateway.log")
    peaks = {"service": Peak(service.pid), "gateway": Peak(gateway.pid)}
    url = f"http://127.0.0.1:{http_port}"
    try:
        wait_ready(url, service)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        for p in peaks.values():
            p.phase = "idle"
        time.sleep(2)
        for p in peaks.values():
            p.phase = "load"
        for _ in range(args.rounds):
            asyncio.run(load(url, args.concurrency, args.max_tokens, model))
    finally:
        results = {name: p.stop() for name, p in peaks.items()}
        for proc in (service, gateway):
            proc.terminate()
            proc.wait(60)
    rows = [{"process": name, **{f"{phase} MiB": round(v / MIB) for phase, v in r.items()}}
            for name, r in results.items()]
    print(table(rows, ["process", "loading MiB", "idle MiB", "load MiB"]))
    path = write_json("memory.json", {"machine": machine(), "args": vars(args), "peak_rss_bytes": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
