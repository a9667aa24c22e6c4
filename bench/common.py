"""Shared bits of Forge's benchmarks: machine description, medians, tables, JSON output."""
from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"

TOPICS = [
    "the water cycle", "black holes", "photosynthesis", "the French revolution", "binary search",
    "how vaccines work", "the stock market", "plate tectonics", "machine learning", "the Roman empire",
    "climate change", "how a CPU works", "the human heart", "volcanoes", "the internet", "jazz music",
    "recursion", "the moon landing", "coffee brewing", "electric cars", "the immune system", "chess openings",
    "quantum computing", "honey bees", "the printing press", "renewable energy", "sleep", "the Great Wall",
    "compilers", "origami", "rainbows", "marathon training",
]
STYLES = ["Explain {} to a ten-year-old.", "Write a short poem about {}."]


def chat_prompts(n: int) -> list[list[dict[str, str]]]:
    """n varied single-turn chat conversations."""
    out = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        style = STYLES[(i // len(TOPICS)) % len(STYLES)]
        out.append([{"role": "user", "content": style.format(topic)}])
    return out


def machine() -> dict[str, object]:
    """The machine a benchmark ran on: CPU model, cores, load, GPUs when nvidia-smi is there."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, object] = {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "python": platform.python_version(),
                               "platform": platform.platform(), "load_average": os.getloadavg()}
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        result = subprocess.run(query, capture_output=True, text=True, timeout=10)
        info["gpus"] = [g.strip() for g in result.stdout.splitlines() if g.strip()]
    return info


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(rows: list[dict[str, object]], columns: list[str]) -> str:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return "" if v is None else str(v)


def write_report(out: Path | None, prefix: str, report: dict) -> Path:
    """Write `report` to `out`, or to bench/results/<prefix>-<time>.json; print and return the path."""
    path = out or RESULTS / f"{prefix}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return path


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=2))
    return path
