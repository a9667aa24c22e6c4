"""Two builds of the native CPU kernels, A/B in one process: engine steps alternate between them.

This machine's speed drifts by 10-20% between runs of a process (another tenant's memory traffic),
which hides a kernel change of a few percent when each build runs in a process of its own. Here
both builds serve one engine, step by step in turn (A, B, A, ...), on the same requests and caches,
so the drift falls on both alike: the same build against itself stays within ~3%. Each build is
the native/cpu sources at a git revision (or the working tree); a build's kernels change no result,
only how fast they run, or the two would part ways (they must give the same bits anyway).

    python bench/kernel_ab.py --a HEAD~1 --b HEAD --batch 8,9,12,16
    python bench/kernel_ab.py --a HEAD --b worktree --batch 1,8,32
    python bench/kernel_ab.py --a HEAD~1 --b HEAD --prefill 500 --rounds 10
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.common import machine, table, write_json  # noqa: E402


def sources_at(revision: str, into: Path) -> list[Path]:
    """The native CPU sources at `revision` ("worktree": as they are on disk), written under `into` with
    the headers beside them; returns the sources (.c)."""
    from forge_service.backends import cpu_build

    folder = cpu_build.SOURCES[0].parent.relative_to(ROOT)
    if revision == "worktree":
        listed = [str(p.relative_to(ROOT)) for p in (ROOT / folder).iterdir()]

        def read(relative: Path) -> str:
            return (ROOT / relative).read_text()
    else:
        listed = subprocess.run(["git", "ls-tree", "--name-only", revision, f"{folder}/"], cwd=ROOT,
                                capture_output=True, text=True, check=True).stdout.split()

        def read(relative: Path) -> str:
            return subprocess.run(["git", "show", f"{revision}:{relative}"], cwd=ROOT, capture_output=True,
                                  text=True, check=True).stdout
    paths = []
    for relative in sorted(Path(p) for p in listed if Path(p).suffix in (".c", ".h")):
        path = into / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(read(relative))
        if path.suffix == ".c":
            paths.append(path)
    return paths


def build(sources: list[Path]) -> ctypes.CDLL:
    """The kernels built from `sources` with this CPU's flags (cached by content, as the engine's)."""
    from forge_service.backends import cpu_build, cpu_kernels

    saved = cpu_build.SOURCES
    cpu_build.SOURCES = sources
    try:
        return cpu_kernels.declare(ctypes.CDLL(str(cpu_build._build(cpu_build.build_flags()))))
    finally:
        cpu_build.SOURCES = saved


def switch_builds(libraries: dict[str, ctypes.CDLL]) -> list[str]:
    """Route the engine's kernel calls to libraries[current[0]]; returns `current`, to set per step."""
    from forge_service.backends import cpu_kernels

    current = ["A"]
    cpu_kernels.library = lambda: libraries[current[0]]  # what every kernel call looks up
    return current


def alternate(libraries: dict[str, ctypes.CDLL], batches: list[int], tokens: int) -> list[dict[str, Any]]:
    """Median step (ms) under each build at each batch of greedy decodes (distinct 20-token prompts)."""
    from forge_service.engine.request import SamplingParams
    from forge_service.llm import LLM

    current = switch_builds(libraries)
    engine = LLM(enable_prefix_caching=False).engine
    rows = []
    for batch in batches:
        for i in range(batch):
            engine.add_request(f"b{batch}-{i}", [1000 + 37 * i + j for j in range(20)],
                               SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        engine.step()  # the prefill
        times: dict[str, list[float]] = {"A": [], "B": []}
        step = 0
        while engine.has_unfinished_requests():
            current[0] = "AB"[step % 2]
            step += 1
            start = time.perf_counter()
            engine.step()
            times[current[0]].append(time.perf_counter() - start)
        a, b = (statistics.median(times[k][3:-3]) * 1000 for k in "AB")
        rows.append({"batch": batch, "a_ms": round(a, 2), "b_ms": round(b, 2), "b_over_a": round(b / a, 3)})
        print(table(rows[-1:], list(rows[-1])), flush=True)
    return rows


def alternate_prefills(libraries: dict[str, ctypes.CDLL], tokens: int, rounds: int) -> dict[str, Any]:
    """Median time (ms) of a `tokens`-token prompt's prefill under each build: distinct random
    prompts, one a step (tokens <= the step budget), the builds taking turns."""
    from forge_service.engine.request import SamplingParams
    from forge_service.llm import LLM

    current = switch_builds(libraries)
    engine = LLM(enable_prefix_caching=False, max_num_batched_tokens=max(512, tokens)).engine
    times: dict[str, list[float]] = {"A": [], "B": []}
    for n in range(2 * rounds + 2):
        current[0] = "AB"[n % 2]
        engine.add_request(f"p{n}", [1000 + (7919 * (n * tokens + j)) % 40000 for j in range(tokens)],
                           SamplingParams(temperature=0, max_tokens=1))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        if n >= 2:  # the first of each warms up
            times[current[0]].append(time.perf_counter() - start)
    a, b = (statistics.median(times[k]) * 1000 for k in "AB")
    return {"prefill_tokens": tokens, "a_ms": round(a, 1), "b_ms": round(b, 1), "b_over_a": round(b / a, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", default="HEAD", help="a git revision, or 'worktree' (default: HEAD)")
    parser.add_argument("--b", default="worktree", help="a git revision, or 'worktree' (default: worktree)")
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 16, 32])
    parser.add_argument("--tokens", type=int, default=160, help="tokens each request decodes (steps per batch)")
    parser.add_argument("--prefill", type=int, default=0,
                        help="instead: prefills of prompts this long, --rounds of them under each build")
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        libraries = {name: build(sources_at(revision, Path(tmp) / name))
                     for name, revision in (("A", args.a), ("B", args.b))}
    if args.prefill:
        rows = [alternate_prefills(libraries, args.prefill, args.rounds)]
        print(table(rows, list(rows[0])))
    else:
        rows = alternate(libraries, args.batch, args.tokens)
        print(table(rows, ["batch", "a_ms", "b_ms", "b_over_a"]))
    path = write_json("kernel_ab.json", {"machine": machine(), "args": vars(args), "rows": rows})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
