"""Building the CPU backend's native kernels (native/cpu/) for this CPU: compiled with the system C
compiler at first use and cached by the sources' content (cpu_kernels.py loads and calls them).

They are written for AVX-512 (VNNI). On a CPU without it but with AVX2, FMA and F16C (AMD before
Zen 4, Intel client cores) the same sources are built on native/cpu/avx2.h, which gives each
AVX-512 operation they use as two 256-bit halves, to the same bits. FORGE_CPU_KERNELS=avx2 takes
that build on any such CPU (to compare the two).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).resolve().parents[2] / "native" / "cpu").glob("*.c"))
CACHE_DIR = Path.home() / ".cache" / "forge" / "cpu"
FLAGS = ["-O3", "-std=c11", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx512dq", "-mf16c",
         "-mfma", "-fopenmp", "-shared", "-fPIC"]
# The same sources for CPUs with AVX2 but not AVX-512 VNNI: avx2.h (beside them), included first,
# supplies the AVX-512 operations they use. Without GCC's RTL global CSE passes (before and after
# register allocation), which spent 100 of ops.c's 148 s (attention was in it then) on the
# header's unrolled vector pairs: the build took about 3 minutes on 2 cores and takes under one, its
# kernels as fast (a Zen 3's decode steps of 1 / 8 / 16 / 32 rows 1.000 / 0.998 / 0.988-1.021 /
# 1.001 of the time, a 500-token prefill 0.945-1.004: steps alternating between the two builds in
# one engine, as bench/kernel_ab.py runs them). C's float semantics hold at any optimisation level,
# so the bits are the same.
AVX2_FLAGS = ["-O3", "-std=c11", "-mavx2", "-mfma", "-mf16c", "-fopenmp", "-shared", "-fPIC", "-DFORGE_AVX2",
              "-fno-gcse", "-fno-gcse-after-reload"]
AVX2_HEADER = "avx2.h"
LINK_FLAGS = ["-shared", "-fopenmp"]  # the objects into the library, with libgomp by soname (quant_gemm.c)
AVX512_CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "f16c", "fma"})
AVX2_CPU_FLAGS = frozenset({"avx2", "f16c", "fma"})


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo's; none where it cannot be read)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return next((frozenset(line.split(":", 1)[1].split()) for line in cpuinfo.splitlines()
                 if line.startswith("flags")), frozenset())


def cpu_has_bf16_dot() -> bool:
    """Whether this CPU has AVX512-BF16 (VDPBF16PS), which attention's scores use where present."""
    return "avx512_bf16" in cpu_flags()


def cpu_runs_avx512() -> bool:
    """Whether this CPU runs the AVX-512 build (else the AVX2 one is built for it)."""
    return AVX512_CPU_FLAGS <= cpu_flags()


def build_flags(bf16_dot: bool | None = None, avx512: bool | None = None) -> list[str]:
    """The compiler flags: FLAGS, and -mavx512bf16 where the CPU has it (`bf16_dot`: this CPU's), or
    AVX2_FLAGS where it lacks AVX-512 VNNI or FORGE_CPU_KERNELS=avx2 asks for them (`avx512`: not)."""
    if avx512 is None:
        avx512 = cpu_runs_avx512() and os.environ.get("FORGE_CPU_KERNELS") != "avx2"
    if not avx512:
        return AVX2_FLAGS
    return FLAGS + (["-mavx512bf16"] if (cpu_has_bf16_dot() if bf16_dot is None else bf16_dot) else [])


def build_for_this_cpu() -> Path:
    """The library for this CPU: with build_flags(), or where the compiler refuses -mavx512bf16 (GCC
    before 10), without it (attention's scores by fused multiply-adds, to the same bits)."""
    flags = build_flags()
    try:
        return _build(flags)
    except subprocess.CalledProcessError as error:
        if flags in (FLAGS, AVX2_FLAGS):
            raise
        log.warning("the compiler refused -mavx512bf16, building without it: %s", error.stderr)
        return _build(FLAGS)


def _build(flags: list[str]) -> Path:
    """The library built with `flags`, from the cache when it is there."""
    compiler = os.environ.get("CC", "cc")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    header = SOURCES[0].parent / AVX2_HEADER
    texts = [p.read_text() for p in [*SOURCES, *headers()]]
    key = hashlib.sha256("\n".join([*texts, " ".join(flags), version]).encode()).hexdigest()[:16]
    target = CACHE_DIR / f"forge_cpu-{key}.so"
    if target.exists():
        return target
    if "-DFORGE_AVX2" in flags:  # the header's text is in the key, not where it lies
        flags = [*flags, "-include", str(header)]
    log.info("building the native CPU kernels for this CPU, once (a minute to a few; then cached in %s)", CACHE_DIR)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:  # then renamed: concurrent builds are safe
        built = Path(tmp) / target.name
        objects = _compile_all(compiler, [f for f in flags if f != "-shared"], Path(tmp))
        subprocess.run([compiler, *LINK_FLAGS, *map(str, objects), "-o", str(built)], capture_output=True,
                       text=True, check=True)
        os.replace(built, target)
    return target


def headers() -> list[Path]:
    """The headers beside the sources (avx2.h, and those the sources include): each is part of the
    build's cache key, so that a change to one builds the library again."""
    return sorted(SOURCES[0].parent.glob("*.h"))


def _compile_all(compiler: str, flags: list[str], out: Path) -> list[Path]:
    """Each source compiled to an object in `out`, all at once: the sources are separate translation
    units (one command with all of them compiles each apart too), so the library linked from these is
    the one a single command builds, and the build takes the longest source's time rather than their sum
    where there are cores for it (on a 2-core Zen 3 the AVX2 build took 42.6 -> 31.4 s, ops.c alone,
    attention in it then, about 29). CalledProcessError, with the compiler's stderr, for the first source that fails."""
    objects = [out / f"{source.stem}.o" for source in SOURCES]
    runs = []
    for source, obj in zip(SOURCES, objects):
        command = [compiler, *flags, "-c", str(source), "-o", str(obj)]
        runs.append((command, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    failed = None
    for command, run in runs:  # every compile waited for, so that none outlives the directory
        stdout, stderr = run.communicate()
        if run.returncode and failed is None:
            failed = subprocess.CalledProcessError(run.returncode, command, stdout, stderr)
    if failed is not None:
        raise failed
    return objects
