"""The CPU attention kernels alone: 30 layers' worth of prefill and decode attention (ms, median of
--reps calls, the best of --rounds), for each build of the native library this CPU can run:
`default` (what Forge loads: scores by VDPBF16PS where the CPU has AVX512-BF16) and `fma` (scores
by fused multiply-adds, as on CPUs without it). Both give the same bits; the ratio is the gain.

    python bench/attention.py --threads 2
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine, write_report  # noqa: E402
from forge_service.backends import cpu_build, cpu_kernels  # noqa: E402

LAYERS = 30
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # the default model's attention


def prefill_call(lib: ctypes.CDLL, context: int, rows: int, threads: int) -> Callable[[], int]:
    """One layer's attention of a chunk of `rows` queries, the last of `context` tokens."""
    width = KV_HEADS * HEAD_DIM
    k = torch.randn(context, width).bfloat16()
    v = torch.randn(context, width).bfloat16()
    slots = torch.randperm(context).to(torch.int64)
    q = torch.randn(rows, HEADS * HEAD_DIM).bfloat16()
    out = torch.empty_like(q)
    return lambda: lib.forge_prefill_attention(q.data_ptr(), HEADS * HEAD_DIM, k.data_ptr(), v.data_ptr(),
                                               slots.data_ptr(), context, rows, HEADS, KV_HEADS, HEAD_DIM,
                                               HEAD_DIM ** -0.5, out.data_ptr(), threads)


def decode_call(lib: ctypes.CDLL, sequences: int, context: int, threads: int) -> Callable[[], int]:
    """One layer's attention of a decode step: `sequences` rows of `context` keys, blocks scattered."""
    width = -(-context // BLOCK)
    blocks = sequences * width
    k = torch.randn(blocks * BLOCK, KV_HEADS * HEAD_DIM).bfloat16()
    v = torch.randn(blocks * BLOCK, KV_HEADS * HEAD_DIM).bfloat16()
    tables = torch.randperm(blocks).view(sequences, width).to(torch.int64).contiguous()
    lens = torch.full((sequences,), context, dtype=torch.int32)
    q = torch.randn(sequences, HEADS * HEAD_DIM).bfloat16()
    out = torch.empty_like(q)
    return lambda: lib.forge_decode_attention(q.data_ptr(), HEADS * HEAD_DIM, k.data_ptr(), v.data_ptr(),
                                              tables.data_ptr(), width, lens.data_ptr(), BLOCK, sequences, HEADS,
                                              KV_HEADS, HEAD_DIM, HEAD_DIM ** -0.5, out.data_ptr(), threads)


def layers_ms(call: Callable[[], int], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        if call():
            raise RuntimeError("the kernel refused its shapes")
        times.append(time.perf_counter() - start)
    return LAYERS * sorted(times)[len(times) // 2] * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON path (default: bench/results/attention-<time>.json)")
    args = parser.parse_args()
    if cpu_kernels.library() is None:
        print("the native CPU kernels cannot run on this machine", file=sys.stderr)
        return 1
    builds = {"default": cpu_kernels.library()}
    if cpu_build.cpu_has_bf16_dot():
        flags = cpu_build.build_flags(bf16_dot=False)
        builds["fma"] = cpu_kernels.declare(ctypes.CDLL(str(cpu_build._build(flags))))
    cases = [(f"prefill {rows} rows at {context}", lambda lib, c=context, r=rows: prefill_call(lib, c, r, args.threads))
             for context, rows in ((128, 121), (500, 121), (1000, 121))]
    cases += [(f"decode {n} x {context} keys", lambda lib, n=n, c=context: decode_call(lib, n, c, args.threads))
              for n, context in ((16, 100), (64, 150), (32, 1000))]
    results = []
    for name, make in cases:
        best: dict[str, float] = {}
        for _ in range(args.rounds):  # the builds alternate
            for build, lib in builds.items():
                ms = layers_ms(make(lib), args.reps)
                best[build] = min(best.get(build, ms), ms)
        line = "  ".join(f"{build} {ms:7.2f} ms" for build, ms in best.items())
        if "fma" in best:
            line += f"  fma / default {best['fma'] / best['default']:.2f}"
        print(f"{name:26s} {line}")
        results.append({"case": name, **{f"{build}_ms": round(ms, 3) for build, ms in best.items()}})
    write_report(args.out, "attention", {"benchmark": "attention", "layers": LAYERS, "threads": args.threads,
                                         "machine": machine(), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
