"""How many int8 products a second this CPU issues: the ceiling the native GEMMs' GMAC/s is read against.

The native GEMMs (native/cpu/quant_gemm.c) multiply int8 activations by 4- and 8-bit weight codes
with one instruction: VPDPBUSD in the AVX-512 VNNI build (64 byte products summed into int32 per
instruction), VPMADDUBSW in the AVX2 build (32 byte products summed in pairs into int16). This runs
short loops of that instruction in assembly, on every thread at once, and reports instructions and
multiply-adds a second:

- `product`: the instruction alone, 8 (AVX2) or 12 (VNNI) independent results, nothing else;
- `product+add` (AVX2): each product added into an int16 sum, as the AVX2 GEMM's q4 codes are;
- `broadcast+product+add` (AVX2): also each product's 4 activation bytes broadcast from memory
  first, the AVX2 GEMM's inner step;
- `broadcast product` (VNNI): the activation bytes broadcast by the instruction's own memory
  operand, the VNNI GEMM's inner step.

The loops are written in assembly so that no compiler can merge or drop their products (a loop in C
once reported half of this CPU's rate: GCC computed its repeated product once). What a GEMM reaches
of `product` is the share of the multiplier's time it keeps busy; the rest is the instructions the
GEMM needs around its products (broadcasts, sums, each group's float scaling) and its memory.

    python bench/product_rate.py
    python bench/product_rate.py --isa avx2 --threads 1,2
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import machine  # noqa: E402
from forge_service.backends import cpu_build  # noqa: E402

# Multiply-adds one instruction does: VPMADDUBSW on 32 byte pairs, VPDPBUSD on 64.
MACS = {"avx2": 32, "avx512": 64}
FLAGS = {"avx2": ["-mavx2"], "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vnni"]}
# Many short rounds, the fastest reported: on a shared machine a quiet moment is the ceiling's measure.
ITERATIONS = 5_000_000  # loop iterations a thread, a round
ROUNDS = 20

SOURCE = r"""
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* 8 (or 12) products an iteration; the activation bytes a broadcast reads cycle through 2 KB. */
static void loop(int kind, long iterations, const int8_t *x) {
    for (long i = 0; i < iterations; i++) {
        const int8_t *p = x + ((i * 256) & 2047);
#ifdef VNNI
        if (kind == 0)
            __asm__ volatile(
                "vpdpbusd %%zmm30, %%zmm31, %%zmm0\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm1\n\t"
                "vpdpbusd %%zmm30, %%zmm31, %%zmm2\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm3\n\t"
                "vpdpbusd %%zmm30, %%zmm31, %%zmm4\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm5\n\t"
                "vpdpbusd %%zmm30, %%zmm31, %%zmm6\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm7\n\t"
                "vpdpbusd %%zmm30, %%zmm31, %%zmm8\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm9\n\t"
                "vpdpbusd %%zmm30, %%zmm31, %%zmm10\n\t vpdpbusd %%zmm30, %%zmm31, %%zmm11"
                :: : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11");
        else
            __asm__ volatile(
                "vpdpbusd 0(%0)%{1to16%}, %%zmm31, %%zmm0\n\t vpdpbusd 32(%0)%{1to16%}, %%zmm31, %%zmm1\n\t"
                "vpdpbusd 64(%0)%{1to16%}, %%zmm31, %%zmm2\n\t vpdpbusd 96(%0)%{1to16%}, %%zmm31, %%zmm3\n\t"
                "vpdpbusd 128(%0)%{1to16%}, %%zmm31, %%zmm4\n\t vpdpbusd 160(%0)%{1to16%}, %%zmm31, %%zmm5\n\t"
                "vpdpbusd 192(%0)%{1to16%}, %%zmm31, %%zmm6\n\t vpdpbusd 224(%0)%{1to16%}, %%zmm31, %%zmm7\n\t"
                "vpdpbusd 4(%0)%{1to16%}, %%zmm31, %%zmm8\n\t vpdpbusd 36(%0)%{1to16%}, %%zmm31, %%zmm9\n\t"
                "vpdpbusd 68(%0)%{1to16%}, %%zmm31, %%zmm10\n\t vpdpbusd 100(%0)%{1to16%}, %%zmm31, %%zmm11"
                :: "r"(p) : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                  "xmm11");
#else
        if (kind == 0)
            __asm__ volatile(
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm0\n\t vpmaddubsw %%ymm14, %%ymm15, %%ymm1\n\t"
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm2\n\t vpmaddubsw %%ymm14, %%ymm15, %%ymm3\n\t"
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm4\n\t vpmaddubsw %%ymm14, %%ymm15, %%ymm5\n\t"
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm6\n\t vpmaddubsw %%ymm14, %%ymm15, %%ymm7"
                :: : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7");
        else if (kind == 1)
            __asm__ volatile(
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm0\n\t vpaddw %%ymm0, %%ymm8, %%ymm8\n\t"
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm1\n\t vpaddw %%ymm1, %%ymm9, %%ymm9\n\t"
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm2\n\t vpaddw %%ymm2, %%ymm10, %%ymm10\n\t"
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm3\n\t vpaddw %%ymm3, %%ymm11, %%ymm11\n\t"
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm4\n\t vpaddw %%ymm4, %%ymm8, %%ymm8\n\t"
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm5\n\t vpaddw %%ymm5, %%ymm9, %%ymm9\n\t"
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm6\n\t vpaddw %%ymm6, %%ymm10, %%ymm10\n\t"
                "vpmaddubsw %%ymm14, %%ymm15, %%ymm7\n\t vpaddw %%ymm7, %%ymm11, %%ymm11"
                :: : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11");
        else
            __asm__ volatile(
                "vpbroadcastd 0(%0), %%ymm0\n\t vpmaddubsw %%ymm0, %%ymm15, %%ymm0\n\t vpaddw %%ymm0, %%ymm8, %%ymm8\n\t"
                "vpbroadcastd 32(%0), %%ymm1\n\t vpmaddubsw %%ymm1, %%ymm15, %%ymm1\n\t vpaddw %%ymm1, %%ymm9, %%ymm9\n\t"
                "vpbroadcastd 64(%0), %%ymm2\n\t vpmaddubsw %%ymm2, %%ymm15, %%ymm2\n\t vpaddw %%ymm2, %%ymm10, %%ymm10\n\t"
                "vpbroadcastd 96(%0), %%ymm3\n\t vpmaddubsw %%ymm3, %%ymm15, %%ymm3\n\t vpaddw %%ymm3, %%ymm11, %%ymm11\n\t"
                "vpbroadcastd 128(%0), %%ymm4\n\t vpmaddubsw %%ymm4, %%ymm15, %%ymm4\n\t vpaddw %%ymm4, %%ymm8, %%ymm8\n\t"
                "vpbroadcastd 160(%0), %%ymm5\n\t vpmaddubsw %%ymm5, %%ymm15, %%ymm5\n\t vpaddw %%ymm5, %%ymm9, %%ymm9\n\t"
                "vpbroadcastd 192(%0), %%ymm6\n\t vpmaddubsw %%ymm6, %%ymm15, %%ymm6\n\t vpaddw %%ymm6, %%ymm10, %%ymm10\n\t"
                "vpbroadcastd 224(%0), %%ymm7\n\t vpmaddubsw %%ymm7, %%ymm15, %%ymm7\n\t vpaddw %%ymm7, %%ymm11, %%ymm11"
                :: "r"(p) : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
                  "xmm11");
#endif
    }
}

#ifdef VNNI
#define PER_ITERATION 12
static const char *NAMES[] = {"product", "broadcast product"};
#else
#define PER_ITERATION 8
static const char *NAMES[] = {"product", "product+add", "broadcast+product+add"};
#endif

/* argv: threads iterations rounds. Prints one line per loop: name, instructions a second (all
 * threads together, the fastest round). */
int main(int argc, char **argv) {
    if (argc != 4) return 2;
    const int threads = atoi(argv[1]), rounds = atoi(argv[3]);
    const long iterations = atol(argv[2]);
    int8_t *x = aligned_alloc(64, 4096);
    if (!x || threads < 1 || rounds < 1 || iterations < 1) return 2;
    for (int i = 0; i < 4096; i++) x[i] = (int8_t)(i * 7);
    for (int kind = 0; kind < (int)(sizeof NAMES / sizeof NAMES[0]); kind++) {
        double best = 0.0;
        for (int r = 0; r < rounds; r++) {
            double start = 0.0, end = 0.0;
#pragma omp parallel num_threads(threads)
            {
#pragma omp barrier
#pragma omp master
                start = now();
#pragma omp barrier
                loop(kind, iterations, x);
#pragma omp barrier
#pragma omp master
                end = now();
            }
            const double rate = (double)threads * iterations * PER_ITERATION / (end - start);
            if (rate > best) best = rate;
        }
        printf("%s\t%.6e\n", NAMES[kind], best);
    }
    free(x);
    return 0;
}
"""


def default_isa() -> str:
    """The build the native kernels run on this CPU (FORGE_CPU_KERNELS=avx2 included): avx512 (VNNI) or avx2."""
    return "avx2" if "-DFORGE_AVX2" in cpu_build.build_flags() else "avx512"


def build(isa: str, directory: Path) -> Path:
    """Compile the probe for `isa` into `directory`; the compiler is $CC, as the kernels' build's."""
    source, binary = directory / "product_rate.c", directory / f"product_rate_{isa}"
    source.write_text(SOURCE)
    defines = ["-DVNNI"] if isa == "avx512" else []
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-fopenmp", *FLAGS[isa], *defines, str(source),
                    "-o", str(binary)], check=True, capture_output=True, text=True)
    return binary


def parse(output: str, isa: str, threads: int) -> list[dict[str, object]]:
    """The probe's lines (name, instructions a second) as rows with GMAC/s."""
    rows = []
    for line in output.splitlines():
        name, rate = line.split("\t")
        per_s = float(rate)
        rows.append({"loop": name, "threads": threads, "g_instr_s": round(per_s / 1e9, 3),
                     "gmac_s": round(per_s * MACS[isa] / 1e9, 1)})
    return rows


def measure(binary: Path, isa: str, threads: int, iterations: int, rounds: int) -> list[dict[str, object]]:
    result = subprocess.run([str(binary), str(threads), str(iterations), str(rounds)], check=True,
                            capture_output=True, text=True)
    return parse(result.stdout, isa, threads)


def run(isa: str, threads: list[int], iterations: int = ITERATIONS, rounds: int = ROUNDS) -> list[dict[str, object]]:
    """Build the probe for `isa` in a temporary directory and measure it on each thread count in turn."""
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="forge-product-rate-") as directory:
        binary = build(isa, Path(directory))
        for count in dict.fromkeys(threads):
            rows.extend(measure(binary, isa, count, iterations, rounds))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", choices=sorted(MACS), default=None,
                        help="the loops' instruction set (default: the build the kernels run here)")
    parser.add_argument("--threads", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1, len(os.sched_getaffinity(0))])
    parser.add_argument("--iterations", type=int, default=ITERATIONS, help="loop iterations a thread, a round")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help="the fastest round is reported")
    args = parser.parse_args(argv)
    isa = args.isa or default_isa()
    rows = run(isa, args.threads, args.iterations, args.rounds)
    for row in rows:
        print(f"{row['loop']:<22} {row['threads']:>2} thread(s): {row['g_instr_s']:7.3f} G instructions/s  "
              f"{row['gmac_s']:7.1f} GMAC/s")
    print(json.dumps({"benchmark": "product_rate", "isa": isa, "macs_per_instruction": MACS[isa],
                      "machine": machine(), "results": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
