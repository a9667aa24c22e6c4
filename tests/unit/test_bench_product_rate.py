"""bench/product_rate.py: the int8 product loops the GEMMs' GMAC/s is read against."""
from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path

import pytest

from bench import product_rate
from forge_service.backends import cpu_build

# The probe is x86 assembly: it builds with a C compiler for an x86 target.
compiler = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None
                              or platform.machine().lower() not in ("x86_64", "amd64"),
                              reason="no C compiler for x86")


def test_parse_gives_each_loop_its_instructions_and_multiply_adds_a_second() -> None:
    rows = product_rate.parse("product\t4.000000e+09\nbroadcast product\t2.500000e+09\n", "avx512", 2)
    assert rows == [{"loop": "product", "threads": 2, "g_instr_s": 4.0, "gmac_s": 256.0},
                    {"loop": "broadcast product", "threads": 2, "g_instr_s": 2.5, "gmac_s": 160.0}]
    assert product_rate.parse("product\t1.0e+09\n", "avx2", 1)[0]["gmac_s"] == 32.0


@compiler
@pytest.mark.parametrize("isa", sorted(product_rate.MACS))
def test_the_probe_builds_for_either_instruction_set(tmp_path: Path, isa: str) -> None:
    assert product_rate.build(isa, tmp_path).is_file()


@compiler
def test_products_alone_outrun_the_gemm_inner_step_on_this_cpu(tmp_path: Path) -> None:
    if cpu_build.cpu_runs_avx512():
        isa = "avx512"
    elif cpu_build.AVX2_CPU_FLAGS <= cpu_build.cpu_flags():
        isa = "avx2"
    else:
        pytest.skip("neither AVX-512 VNNI nor AVX2")
    rows = product_rate.measure(product_rate.build(isa, tmp_path), isa, 1, 500_000, 5)
    rate = {row["loop"]: row["g_instr_s"] for row in rows}
    inner = "broadcast product" if isa == "avx512" else "broadcast+product+add"
    assert set(rate) == ({"product", inner} if isa == "avx512" else {"product", "product+add", inner})
    assert all(r > 0 for r in rate.values())
    # A broadcast and a sum besides each product cannot make the products come faster.
    assert rate["product"] > 0.9 * rate[inner]
