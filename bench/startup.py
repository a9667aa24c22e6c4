"""Start-up time of the default model: in process (`LLM()`, the engine ready to step) and served
(`forge serve` until the gateway's /health answers 200), the figure a startup probe is sized from.
Each is measured `--repeats` times in fresh processes; medians.

    .venv/bin/python bench/startup.py --repeats 3
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, table, write_json  # noqa: E402
from bench.observability_overhead import _ready, free_port  # noqa: E402

IN_PROCESS = ("import time; from forge_service import LLM; start = time.perf_counter(); LLM(); "
              "print(time.perf_counter() - start)")


def in_process() -> float:
    out = subprocess.run([sys.executable, "-c", IN_PROCESS], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def served(timeout: float = 300) -> float:
    http_port = free_port()
    argv = [sys.executable, "-m", "forge_service.cli", "serve", "--grpc-port", str(free_port()), "--http-port",
            str(http_port), "--metrics-port", "0", "--log-level", "warning"]
    start = time.monotonic()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        while True:
            if _ready(f"http://127.0.0.1:{http_port}"):
                return time.monotonic() - start
            if proc.poll() is not None or time.monotonic() - start > timeout:
                raise RuntimeError(f"forge serve exited or was not ready in {timeout} s")
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    runs = {"LLM() in process": [], "forge serve to /health 200": []}
    for _ in range(args.repeats):  # alternated, so a slow spell of the machine hits both
        runs["LLM() in process"].append(in_process())
        runs["forge serve to /health 200"].append(served())
    rows = [{"what": what, "median_s": round(statistics.median(s), 2), "runs_s": [round(x, 2) for x in s]}
            for what, s in runs.items()]
    print(table(rows, ["what", "median_s", "runs_s"]))
    print(f"wrote {write_json('startup.json', {'machine': machine(), 'args': vars(args), 'rows': rows})}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
