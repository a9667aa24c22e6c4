"""Engine step time without servers: median decode step (ms) at several batch sizes.

Each batch size gets its own requests (distinct 20-token prompts, ignore_eos); steps that carry
a prefill chunk are left out, so the figure is the decode step alone. Also reported: the time from
a step's start to its model run's launch (scheduling and building the inputs), which is how much
later than its step a server posts a token (AsyncEngine).

With --floor, also the least a decode step can take for its weights alone: the bytes of packed
weights every step reads once (each projection's and the lm_head's codes and scales), over this
machine's read bandwidth (the best of five sums over 512 MB, past any cache). One stream's step
cannot be faster than that; how far above it the measured step sits is the step's work besides
streaming the weights (Python, the small ops between GEMMs, waiting threads).

With --gemm-bound, also the GEMMs alone: every packed weight (each projection of every layer, and
the lm_head) multiplied by as many rows as each batch size, one after another as a step runs them,
on the same native kernels and activation levels as the engine (the best of five rounds). Their
time is what a step of that many rows spends in GEMMs at the least, and rows over it bounds the
tokens/s any number of streams can reach here, before attention, Python and serving take their
share: where it falls short of a target, the GEMMs' compute is the limit, not the bytes. (The inputs
are Gaussian, so few groups take the second activation level: a slight underestimate of the cost.
At a row or a few, the weights' bytes bound a step instead, and each of these separate calls adds
its own start, which the engine's one call per step does not pay: there --floor is the bound.)
Their GMAC/s is then given as a share of what bench/product_rate.py's loops reach in the same run,
on as many threads: the kernels' int8 product instruction alone, and in the GEMM's inner step.

    python bench/decode_step.py --batch 1,16 --dtype bfloat16
    python bench/decode_step.py --batch 1 --floor
    python bench/decode_step.py --batch 1,32,64 --gemm-bound
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import product_rate  # noqa: E402
from bench.common import machine  # noqa: E402
from forge_service.backends import cpu_kernels  # noqa: E402
from forge_service.backends.cpu_kernels import QuantWeight  # noqa: E402
from forge_service.backends.cpu_linear import CpuWeight  # noqa: E402
from forge_service.engine.request import SamplingParams  # noqa: E402
from forge_service.llm import LLM  # noqa: E402


def decode_steps_ms(llm: LLM, batch: int, steps: int, tag: str) -> tuple[list[float], list[float]]:
    """Each decode step's time, and its time to the model run's launch (ms)."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", [1000 + 37 * i + j for j in range(20)], params)
    times: list[float] = []
    to_launch: list[float] = []
    launched: list[float] = []
    while engine.has_unfinished_requests():
        prefilling = any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.num_waiting > 0
        launched.clear()
        start = time.perf_counter()
        engine.step(on_launch=lambda: launched.append(time.perf_counter()))
        if not prefilling:
            times.append((time.perf_counter() - start) * 1000)
            to_launch.append((launched[0] - start) * 1000)
    return times, to_launch


def packed_weight_bytes() -> int:
    """Bytes of the packed weights alive in this process (codes, scales, offsets): what a decode
    step streams once. Found by the collector, since the backend keeps them inside its layers."""
    weights = {id(o): o for o in gc.get_objects() if type(o) is QuantWeight}.values()  # type(): no module __getattr__
    return sum(t.nbytes for w in weights for t in (w.codes, w.scale, w.offset) if t is not None)


def read_bandwidth(mib: int = 512, tries: int = 5) -> float:
    """This machine's memory read bandwidth (bytes/s) with torch's threads: the best of `tries`
    sums over `mib` MiB, far past any cache."""
    data = torch.ones(mib << 17, dtype=torch.float64)
    best = float("inf")
    for _ in range(tries):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.nbytes / best


def native_weights() -> list[CpuWeight]:
    """Each weight this process holds on the native kernels, once (found by the collector, as
    packed_weight_bytes finds them), with the activation levels the engine gives it."""
    weights = {id(o): o for o in gc.get_objects() if type(o) is CpuWeight and o.native is not None}
    return list(weights.values())


def gemm_bound(weights: list[CpuWeight], rows: int, rounds: int = 5) -> dict[str, float]:
    """The GEMMs of a step of `rows` rows: every weight times `rows` bf16 rows, in turn, on the native
    kernels at its levels; the best of `rounds` passes. Returns the pass's time (ms), its
    multiply-adds per second (GMAC/s) and rows per second (the tokens/s that time allows)."""
    inputs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {w.native.shape[1] for w in weights}}
    macs = rows * sum(n * k for n, k in (w.native.shape for w in weights))
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for w in weights:
            cpu_kernels.linear(inputs[w.native.shape[1]], w.native, w.levels)
        best = min(best, time.perf_counter() - start)
    return {"rows": rows, "gemm_ms": round(best * 1000, 2), "gmac_s": round(macs / best / 1e9, 1),
            "tok_s_bound": round(rows / best, 1)}


def product_shares(bounds: list[dict[str, float]], rates: list[dict[str, object]]) -> list[dict[str, float]]:
    """Each GEMM bound's GMAC/s as a share of each product-rate loop's (bench/product_rate.py rows)."""
    return [{"rows": bound["rows"], **{str(rate["loop"]): round(bound["gmac_s"] / float(rate["gmac_s"]), 3)
                                       for rate in rates}} for bound in bounds]


def product_rates(threads: int) -> list[dict[str, object]]:
    """bench/product_rate.py's loops for the kernels' build on `threads` threads (none where the probe
    does not build or run: no compiler, or not this CPU's instructions)."""
    try:
        return product_rate.run(product_rate.default_isa(), [threads])
    except (OSError, subprocess.CalledProcessError):
        return []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--floor", action="store_true",
                        help="also the step time the weights' bytes alone take at this machine's read bandwidth")
    parser.add_argument("--gemm-bound", action="store_true",
                        help="also the GEMMs alone at each batch size, and the tokens/s they allow")
    args = parser.parse_args(argv)
    llm = LLM(model=args.model, dtype=args.dtype)
    decode_steps_ms(llm, 1, 4, "warmup")
    rows = []
    for batch in args.batch:
        times, to_launch = decode_steps_ms(llm, batch, args.steps, f"b{batch}")
        ms, launch_ms = statistics.median(times), statistics.median(to_launch)
        rows.append({"batch": batch, "step_ms_p50": round(ms, 2), "tok_s": round(batch * 1000 / ms, 1),
                     "to_launch_ms_p50": round(launch_ms, 3)})
        print(f"batch {batch:>3}: decode step p50 {ms:7.2f} ms  {batch * 1000 / ms:7.1f} tok/s  "
              f"to launch {launch_ms:6.3f} ms")
    report = {"benchmark": "decode_step", "dtype": str(llm.engine.dtype), "machine": machine(), "results": rows}
    if args.floor:
        weights, bandwidth = packed_weight_bytes(), read_bandwidth()
        if weights:
            floor_ms = weights / bandwidth * 1000
            report["floor"] = {"weight_mb": round(weights / 1e6, 1), "read_gb_s": round(bandwidth / 1e9, 1),
                               "step_ms": round(floor_ms, 2), "tok_s_one_stream": round(1000 / floor_ms, 1)}
            print(f"weights read per step {weights / 1e6:.1f} MB, read bandwidth {bandwidth / 1e9:.1f} GB/s: "
                  f"a step takes at least {floor_ms:.2f} ms ({1000 / floor_ms:.1f} tok/s at one stream)")
        else:
            print("no packed weights in this process (a dense model or backend): no floor from them")
    if args.gemm_bound:
        weights = native_weights()
        if weights:
            report["gemm_bound"] = [gemm_bound(weights, batch) for batch in args.batch]
            for bound in report["gemm_bound"]:
                print(f"batch {bound['rows']:>3}: GEMMs alone {bound['gemm_ms']:7.2f} ms  {bound['gmac_s']:6.1f} GMAC/s"
                      f"  at most {bound['tok_s_bound']:7.1f} tok/s")
            rates = product_rates(torch.get_num_threads())
            if rates:
                report["product_rate"] = rates
                report["gemm_share_of_products"] = product_shares(report["gemm_bound"], rates)
                print("the same threads' int8 products (bench/product_rate.py): " +
                      ", ".join(f"{r['loop']} {r['gmac_s']} GMAC/s" for r in rates))
                for share in report["gemm_share_of_products"]:
                    print(f"batch {share['rows']:>3}: the GEMMs reach " +
                          ", ".join(f"{share[str(r['loop'])]:.0%} of {r['loop']}" for r in rates))
            else:
                print("bench/product_rate.py's probe did not build or run here: no share of the product rate")
        else:
            print("no weights on the native kernels in this process: no GEMM bound")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
