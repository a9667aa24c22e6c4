"""bench/decode_step.py --floor: the packed weights a decode step streams, and the read bandwidth
they are divided by; --gemm-bound: the GEMMs of a step timed alone."""
from __future__ import annotations

import gc

import torch

from bench import decode_step
from forge_service.backends import cpu_build, cpu_kernels
from forge_service.backends.cpu_linear import CpuWeight


def test_packed_weight_bytes_counts_each_packed_weight_once_with_its_scales_and_offsets() -> None:
    gc.collect()
    before = decode_step.packed_weight_bytes()
    q4 = cpu_kernels.pack_q4(torch.randint(0, 16, (32, 64), dtype=torch.uint8), torch.rand(32, 2), torch.rand(32, 2))
    q8 = cpu_kernels.pack_q8(torch.randn(48, 96))
    shared = [q4, q4, (q8, 2)]  # held twice, as a layer and a table of layers may hold one weight
    # q4: 32 x 64 codes at 4 bits, fp16 scale and offset per 32; q8: 48 x 96 bytes, fp16 scale per 32
    expected = 32 * 64 // 2 + 2 * 2 * 32 * 2 + 48 * 96 + 2 * 48 * 3
    assert decode_step.packed_weight_bytes() - before == expected
    del shared, q4, q8
    gc.collect()
    assert decode_step.packed_weight_bytes() == before


def test_read_bandwidth_is_the_bytes_over_the_fastest_sum(monkeypatch) -> None:
    times = iter([10.0, 10.5, 20.0, 20.25, 30.0, 30.125])  # sums of 0.5, 0.25 and 0.125 s
    monkeypatch.setattr(decode_step.time, "perf_counter", lambda: next(times))
    assert decode_step.read_bandwidth(mib=1, tries=3) == (1 << 20) / 0.125


def test_native_weights_are_each_weight_on_the_native_kernels_once() -> None:
    gc.collect()
    before = {id(w) for w in decode_step.native_weights()}
    native = CpuWeight(native=cpu_kernels.pack_q8(torch.randn(32, 64)), levels=1)
    torch_only = CpuWeight(int8=torch.zeros(32, 64, dtype=torch.int8))  # torch's form: not the native kernels'
    held = [native, native, torch_only]
    assert [w for w in decode_step.native_weights() if id(w) not in before] == [native]
    del held, native, torch_only


def test_gemm_bound_times_every_weight_at_its_levels_and_keeps_the_fastest_pass(monkeypatch) -> None:
    weights = [CpuWeight(native=cpu_kernels.pack_q8(torch.randn(48, 64)), levels=1),
               CpuWeight(native=cpu_kernels.pack_q8(torch.randn(32, 96)), levels=2)]
    calls = []
    monkeypatch.setattr(decode_step.cpu_kernels, "linear",
                        lambda x, w, levels: calls.append((tuple(x.shape), w.shape, levels, x.dtype)))
    times = iter([1.0, 1.0005, 2.0, 2.00025, 3.0, 3.0005])  # passes of 0.5, 0.25 and 0.5 ms
    monkeypatch.setattr(decode_step.time, "perf_counter", lambda: next(times))
    bound = decode_step.gemm_bound(weights, rows=64, rounds=3)
    assert calls == 3 * [((64, 64), (48, 64), 1, torch.bfloat16), ((64, 96), (32, 96), 2, torch.bfloat16)]
    # 64 rows x (48 x 64 + 32 x 96) = 393,216 multiply-adds in 0.25 ms
    assert bound == {"rows": 64, "gemm_ms": 0.25, "gmac_s": 1.6, "tok_s_bound": 256000.0}


def test_product_shares_are_each_bound_over_each_loop() -> None:
    bounds = [{"rows": 1, "gemm_ms": 9.0, "gmac_s": 15.0, "tok_s_bound": 111.1},
              {"rows": 32, "gemm_ms": 54.0, "gmac_s": 80.0, "tok_s_bound": 592.6}]
    rates = [{"loop": "product", "threads": 2, "g_instr_s": 11.72, "gmac_s": 375.0},
             {"loop": "broadcast+product+add", "threads": 2, "g_instr_s": 5.0, "gmac_s": 160.0}]
    assert decode_step.product_shares(bounds, rates) == [
        {"rows": 1, "product": 0.04, "broadcast+product+add": 0.094},
        {"rows": 32, "product": 0.213, "broadcast+product+add": 0.5}]


def test_product_rates_run_the_kernels_build_on_the_given_threads(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(decode_step.product_rate, "build", lambda isa, directory: directory / isa)
    monkeypatch.setattr(decode_step.product_rate, "measure",
                        lambda binary, isa, threads, iterations, rounds: calls.append((binary.name, isa, threads))
                        or [{"loop": "product", "threads": threads, "g_instr_s": 1.0, "gmac_s": 32.0}])
    rows = decode_step.product_rates(3)
    isa = "avx2" if "-DFORGE_AVX2" in cpu_build.build_flags() else "avx512"
    assert calls == [(isa, isa, 3)] and rows[0]["threads"] == 3


def test_product_rates_are_none_without_a_compiler(monkeypatch) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert decode_step.product_rates(2) == []
