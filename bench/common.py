"""Shared bits of Forge's benchmarks: machine description, medians, tables, JSON output."""
from __future__ import annotations

import json
import os
import platform
import statistics
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
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()}


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))
    return s[k]


def table(rows: list[dict[str, object]], columns: list[str]) -> str:
    cells = [[_fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "| " + " | ".join(v.ljust(w) for v, w in zip(vals, widths)) + " |"
    return "\n".join([line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return "" if v is None else str(v)


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / name
    path.write_text(json.dumps(payload, indent=2))
    return path
