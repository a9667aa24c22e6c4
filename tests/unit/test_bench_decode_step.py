"""bench/decode_step.py --floor: the packed weights a decode step streams, and the read bandwidth
they are divided by."""
from __future__ import annotations

import gc

import torch

from bench import decode_step
from forge_service.backends import cpu_kernels


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
