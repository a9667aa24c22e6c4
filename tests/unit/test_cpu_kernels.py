"""The CPU backend's native kernels (native/cpu/quant_gemm.c) against a torch emulation of their
arithmetic, and against the exact product."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from forge_service.backends import base, cpu_build, cpu_kernels, torch_ref
from forge_service.backends.base import Int8Weight

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None,
                                reason="the native CPU kernels cannot run on this machine")

SHAPES = [(16, 32), (48, 96), (960, 576), (576, 1536)]  # [N, K]: one tile, odd tiles, the default model's


def _codes(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    # fp16-exact scales and zeros, as a Q4_1 file stores them
    scale = (torch.rand(n, k // 32, generator=g) * 0.01).half().float()
    zero = ((torch.rand(n, k // 32, generator=g) - 0.5) * 0.02).half().float() + 8 * scale
    return codes, scale, zero


def _activations(x: torch.Tensor, levels: int = 2, fine_above: float = cpu_kernels.FINE_ABOVE) -> torch.Tensor:
    """The int8 levels the kernels quantise x [M, K] to, per group of 32, as fp64 values."""
    m, k = x.shape
    groups = x.float().view(m, k // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    second = (levels == 2) & (amax ** 2 > fine_above ** 2 * x.float().pow(2).mean(-1)[:, None, None])
    scaled = groups * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    coarse = torch.round(scaled).clamp(-127, 127)
    fine = torch.round((scaled - coarse) * 254).clamp(-127, 127) * second
    return ((coarse.double() + fine.double() / 254) * (amax.double() / 127)).view(m, k)


def _with_outliers(rows: int, k: int, seed: int) -> torch.Tensor:
    """Activations shaped like a model's: a few channels far larger than the rest, in some rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g)
    channels = torch.randperm(k, generator=g)[:max(1, k // 200)]
    x[::2, channels] *= 20
    x[1::3, torch.randint(0, k, (1,), generator=g)] = 30
    return x


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _emulated(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether the kernel's output is its arithmetic's (`want`) up to fp32 rounding. An fp32
    rounding can move one activation level at a rounding tie by a step, which moves the outputs of
    its row by up to amax / 127 of a weight: over hundreds of rows a few outputs do. A wrong
    kernel misses nearly everywhere."""
    errors = (got.double() - want.double()).abs() / want.double().abs().max()
    return bool((errors > 1e-5).double().mean() < 0.01 and errors.max() < 2e-3)


@pytest.mark.parametrize("n,k", SHAPES)
def test_q4_packing_keeps_every_weight(n: int, k: int) -> None:
    codes, scale, zero = _codes(n, k, seed=n + k)
    want = ((codes.float() - 8).view(n, k // 32, 32) * scale[..., None] + zero[..., None]).view(n, k)
    assert torch.allclose(cpu_kernels.dequantize(cpu_kernels.pack_q4(codes, scale, zero)), want, atol=1e-6)


# Every batch size takes these kernels: decode steps, blocks of 8 rows and their tails, prefill chunks.
ROWS = [1, 2, 3, 5, 7, 8, 9, 24, 25, 64, 200, 512]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_q4_linear_computes_its_quantised_product(n: int, k: int, rows: int) -> None:
    codes, scale, zero = _codes(n, k, seed=n * k + rows)
    w = cpu_kernels.pack_q4(codes, scale, zero)
    dense = cpu_kernels.dequantize(w).double().T
    x = _with_outliers(rows, k, seed=rows)
    exact = x.double() @ dense
    got = cpu_kernels.linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (rows, n)
    assert _emulated(got, _activations(x) @ dense)  # the kernel's own arithmetic
    everywhere = cpu_kernels.linear(x, w, fine_above=0.0)
    assert _emulated(everywhere, _activations(x, fine_above=0.0) @ dense)
    assert _rel(everywhere, exact) < 2e-3  # within 16-bit activation error of exact
    one_level = cpu_kernels.linear(x, w, levels=1)
    assert _emulated(one_level, _activations(x, levels=1) @ dense)
    if k >= 576:  # the default model's rows: the second level in outlier groups brings the product close
        assert _rel(one_level, exact) > 2 * _rel(got, exact)
    bf16 = cpu_kernels.linear(x.bfloat16(), w)
    assert bf16.dtype == torch.bfloat16 and _rel(bf16, _activations(x.bfloat16()) @ dense) < 4e-3  # bf16 output


@pytest.mark.parametrize("n,k", SHAPES)
def test_q8_packing_keeps_a_checkpoint_s_int8_codes(n: int, k: int) -> None:
    """Q8_0 codes (and Q6_K/Q5_K re-quantised to int8) go into the kernels' layout unchanged."""
    w = Int8Weight.quantize(torch.randn(n, k) * 0.05)
    assert w.codes.abs().max() == 127
    assert torch.equal(cpu_kernels.dequantize(cpu_kernels.pack_q8_codes(w)), w.dequantize())


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("levels", [1, 2])
def test_q8_linear_tracks_the_dense_weight(n: int, k: int, levels: int) -> None:
    g = torch.Generator().manual_seed(n)
    weight = torch.randn(n, k, generator=g) * 0.05
    w = cpu_kernels.pack_q8(weight)
    assert _rel(cpu_kernels.dequantize(w), weight) < 0.01  # int8 per group of 32
    for rows in (1, 7, 24, 25, 64, 200, 512):
        x = torch.randn(rows, k, generator=g)
        got = cpu_kernels.linear(x, w, levels)
        assert _emulated(got, _activations(x, levels) @ cpu_kernels.dequantize(w).double().T)
        assert _rel(got, x.double() @ weight.double().T) < 0.02


@pytest.mark.parametrize("n,k", SHAPES[2:])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_does_not_depend_on_the_rows_batched_with_it(n: int, k: int, bits: int) -> None:
    """Rows share passes over the weights in blocks of 8, and a block runs the second level over
    every group that some row of it needs; each row's result must still be its own alone, and the
    same whatever the batch size or the split into chunks (greedy determinism rests on it)."""
    codes, scale, zero = _codes(n, k, seed=k)
    w = cpu_kernels.pack_q4(codes, scale, zero) if bits == 4 else cpu_kernels.pack_q8(torch.randn(n, k) * 0.05)
    x = _with_outliers(200, k, seed=n).bfloat16()
    batched = cpu_kernels.linear(x, w)
    for i in range(len(x)):
        assert torch.equal(batched[i], cpu_kernels.linear(x[i:i + 1], w)[0]), f"row {i}"
    for cut in (7, 25, 64):  # chunked as a prefill would be, or a decode step beside it
        parts = [cpu_kernels.linear(x[a:a + cut], w) for a in range(0, len(x), cut)]
        assert torch.equal(torch.cat(parts), batched), f"chunks of {cut}"


def test_a_zero_group_stays_zero() -> None:
    weight = torch.zeros(16, 64)
    weight[3, 40] = 1.0
    x = torch.zeros(2, 64)
    x[1, 40] = 2.0
    got = cpu_kernels.linear(x, cpu_kernels.pack_q8(weight))
    assert got[0].abs().max() == 0 and got[1, 3] == pytest.approx(2.0, rel=1e-2)


def test_unsupported_inputs_are_refused() -> None:
    w = cpu_kernels.pack_q8(torch.randn(16, 64))
    with pytest.raises(ValueError, match="input"):
        cpu_kernels.linear(torch.randn(2, 32), w)
    with pytest.raises(ValueError, match="input"):
        cpu_kernels.linear(torch.randn(2, 64).half(), w)
    with pytest.raises(ValueError, match="levels"):
        cpu_kernels.linear(torch.randn(2, 64), w, levels=3)
    with pytest.raises(ValueError, match="fine_above"):
        cpu_kernels.linear(torch.randn(2, 64), w, fine_above=-1.0)
    assert not cpu_kernels.supports((24, 64)) and not cpu_kernels.supports((16, 48))
    assert cpu_kernels.supports((32, 64))


# ---- the bf16 decode path's other ops, against the torch code they replace ----

def _bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between two bf16 tensors in units in the last place."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


def test_add_rms_norm_matches_the_torch_norm() -> None:
    from forge_service.backends.torch_ref import rms_norm

    g = torch.Generator().manual_seed(0)
    residual = torch.randn(5, 576, generator=g) * 3
    delta = torch.randn(5, 576, generator=g).bfloat16()
    weight = (torch.rand(576, generator=g) + 0.5).bfloat16()
    want_residual = residual + delta.float()
    want = rms_norm(want_residual, weight, 1e-5)
    mine = residual.clone()
    got = cpu_kernels.add_rms_norm(mine, delta, weight, 1e-5)
    assert torch.equal(mine, want_residual)  # the residual stream is updated in place, exactly
    assert got.dtype == torch.bfloat16 and _bf16_ulps(got, want) <= 1  # summation order may differ
    assert (got == want).float().mean() > 0.99
    untouched = residual.clone()
    assert _bf16_ulps(cpu_kernels.add_rms_norm(untouched, None, weight, 1e-5), rms_norm(residual, weight, 1e-5)) <= 1
    assert torch.equal(untouched, residual)


def test_final_norm_gathers_adds_and_normalises_the_logit_rows_as_the_torch_ops_do() -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 576, generator=g) * 3
    delta = torch.randn(40, 576, generator=g).bfloat16()
    weight = torch.rand(576, generator=g) + 0.5  # fp32, as the model's final norm keeps it
    rows = torch.tensor([39, 0, 17, 17, 5])
    before = x.clone()
    for d in (delta, None):
        h, low = cpu_kernels.final_norm(x, d, rows, weight, 1e-5)
        want, want_low = torch_ref.final_norm(x, d, rows, weight, 1e-5, torch.bfloat16)
        assert h.dtype == torch.float32 and h.shape == (5, 576) and low.dtype == torch.bfloat16
        assert torch.allclose(h, want, rtol=1e-6, atol=0)  # the sum of squares in another order
        assert torch.equal(low, h.bfloat16())  # rounded to nearest even, as torch casts
        assert (low == want_low).float().mean() > 0.99
        assert torch.equal(h[2], h[3])  # a row's result is its own, wherever it is listed
        alone, _ = cpu_kernels.final_norm(x, d, rows[2:3], weight, 1e-5)
        assert torch.equal(alone[0], h[2])
    assert torch.equal(x, before)  # the residual stream is read, not written
    with pytest.raises(IndexError):
        cpu_kernels.final_norm(x, delta, torch.tensor([0, 40]), weight, 1e-5)
    with pytest.raises(IndexError):
        cpu_kernels.final_norm(x, delta, torch.tensor([-1]), weight, 1e-5)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_widened_gemm_stores_the_bf16_results_as_fp32(bits: int) -> None:
    """The lm_head's logits, stored as fp32 by the GEMM itself: the values its bf16 output holds."""
    n, k = 960, 576
    codes, scale, zero = _codes(n, k, seed=3)
    w = cpu_kernels.pack_q4(codes, scale, zero) if bits == 4 else cpu_kernels.pack_q8(torch.randn(n, k) * 0.05)
    for rows in (1, 16, 65):
        x = _with_outliers(rows, k, seed=rows).bfloat16()
        for levels in (1, 2):
            got = cpu_kernels.linear(x, w, levels, widened=True)
            assert got.dtype == torch.float32
            assert torch.equal(got, cpu_kernels.linear(x, w, levels).float())


def test_silu_mul_matches_torch() -> None:
    gate_up = (torch.randn(3, 2 * 1536, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = cpu_kernels.silu_mul(gate_up)
    assert _bf16_ulps(got, want) <= 1 and (got == want).float().mean() > 0.99


def test_rotary_in_place_matches_the_torch_rotation() -> None:
    from forge_service.backends.torch_ref import apply_rotary, rotary_tables
    from forge_service.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(64, 4096, 10000.0)
    cos, sin = rotary_tables(rope.cos, rope.sin, torch.tensor([0, 7, 300, 4000]), torch.bfloat16)
    qkv = torch.randn(4, 15 * 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    qk = qkv[:, :12 * 64].view(4, 12, 64)  # a strided view, as the model passes it
    want = apply_rotary(qk.clone(), cos, sin)
    v_before = qkv[:, 12 * 64:].clone()
    assert cpu_kernels.rotary_supported(qk, cos, sin)
    cpu_kernels.rotary_(qk, cos, sin)
    assert torch.equal(qk, want)
    assert torch.equal(qkv[:, 12 * 64:], v_before)  # the values beside it are untouched


def test_head_rms_norm_in_place_matches_the_torch_norm_per_head() -> None:
    from forge_service.backends.torch_ref import head_rms_norm

    g = torch.Generator().manual_seed(3)
    qkv = (torch.randn(40, 14 * 64, generator=g) * 3).bfloat16()  # 40 rows: the threaded loop too
    qk = qkv[:, :12 * 64].view(40, 12, 64)  # 8 query heads, 4 key heads, then the values
    q_weight, k_weight = ((torch.rand(64, generator=g) + 0.5).bfloat16() for _ in range(2))
    want = head_rms_norm(qk.clone(), 8, q_weight, k_weight, 1e-6)
    v_before = qkv[:, 12 * 64:].clone()
    assert cpu_kernels.head_norm_supported(qk, q_weight)
    cpu_kernels.head_rms_norm_(qk, 8, q_weight, k_weight, 1e-6)
    assert _bf16_ulps(qk, want) <= 1 and (qk == want).float().mean() > 0.99  # summation order may differ
    assert torch.equal(qkv[:, 12 * 64:], v_before)
    # each head its own weight: the key heads' weight on a query head is a different answer
    wrong = head_rms_norm(qk.clone(), 12, k_weight, k_weight, 1e-6)
    assert (wrong != want).float().mean() > 0.5


def test_add_bias_rounds_as_a_torch_bf16_sum() -> None:
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(40, 96, generator=g) * 4).bfloat16()
    bias = torch.randn(96, generator=g).bfloat16()
    want = x + bias
    cpu_kernels.library().forge_add_bias(x.data_ptr(), 40, 96, 96, bias.data_ptr(), 2)
    assert torch.equal(x, want)


PAGED_BLOCK = 16  # the block size of paged_attention_case's caches


def paged_attention_case(heads: int, kv_heads: int, hd: int, lens: list[int]) -> tuple[torch.Tensor, ...]:
    """q [D, H, hd], K and V caches with each sequence's blocks scattered, block tables, lens."""
    g = torch.Generator().manual_seed(heads)
    bs = PAGED_BLOCK
    num_blocks = sum(-(-n // bs) for n in lens) + 3
    k_cache = torch.randn(num_blocks * bs, kv_heads, hd, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks * bs, kv_heads, hd, generator=g).bfloat16()
    blocks = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-n // bs) for n in lens)
    tables = []
    for n in lens:
        own, blocks = blocks[:-(-n // bs)], blocks[-(-n // bs):]
        tables.append(own + [0] * (width - len(own)))
    q = torch.randn(len(lens), heads, hd, generator=g).bfloat16()
    return q, k_cache, v_cache, torch.tensor(tables), torch.tensor(lens)


def assert_attention_matches_fp32(got: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                  tables: torch.Tensor, lens: torch.Tensor) -> None:
    heads, kv_heads, hd, bs = q.shape[1], k_cache.shape[1], q.shape[2], PAGED_BLOCK
    for d, n in enumerate(lens.tolist()):
        slots = torch.tensor([tables[d][i // bs] * bs + i % bs for i in range(n)])
        keys = k_cache[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [H, n, hd]
        values = v_cache[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        probs = torch.softmax(q[d].float()[:, None, :] @ keys.transpose(1, 2) * hd ** -0.5, dim=-1)
        want = (probs @ values)[:, 0]  # [H, hd]
        assert (got[d].float() - want).abs().max() < 1e-2 * want.abs().max(), d


# Heads per KV head (1 to 4 run together, 6 and 8 in runs of at most 4); head sizes with their own
# compiled loop (64, 128) and without (96); one to five sequences, which the kernel splits between
# threads by sequence or by heads.
@pytest.mark.parametrize("heads,kv_heads,hd,lens", [
    (9, 3, 64, [1, 17, 100, 33]), (4, 4, 64, [1, 17, 100, 33]), (9, 3, 64, [250]), (8, 2, 128, [40, 7]),
    (6, 2, 96, [16, 1, 33, 64, 5]), (12, 2, 64, [30, 3]), (16, 2, 128, [20]), (4, 2, 64, [19, 45])])
def test_decode_attention_matches_fp32_attention_over_the_paged_cache(heads: int, kv_heads: int, hd: int,
                                                                      lens: list[int]) -> None:
    case = paged_attention_case(heads, kv_heads, hd, lens)
    got = cpu_kernels.decode_attention(*case, PAGED_BLOCK, hd ** -0.5)
    assert_attention_matches_fp32(got, *case)


# Threads take runs of consecutive sequences and then help with each other's, fetching the next
# sequence's keys while they compute: every sequence must be computed once, to the same bits,
# whatever the number of threads (fewer sequences than threads, about as many, many more).
@pytest.mark.parametrize("threads", [1, 2, 3, 5])
@pytest.mark.parametrize("lens", [[33, 7], [1, 17, 100, 33, 250], [5, 64, 1, 129, 48, 2, 16, 90, 31, 300, 8, 77, 12]])
def test_decode_attention_gives_each_sequence_the_same_bits_whatever_the_threads(threads: int,
                                                                                 lens: list[int]) -> None:
    case = paged_attention_case(9, 3, 64, lens)
    want = cpu_kernels.decode_attention(*case, PAGED_BLOCK, 0.125)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_kernels.decode_attention(*case, PAGED_BLOCK, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, want)
    assert_attention_matches_fp32(got, *case)


@pytest.mark.parametrize("context,chunk", [(37, 37), (100, 24), (50, 1)])
@pytest.mark.parametrize("heads,kv_heads,hd", [(6, 2, 32), (9, 3, 64), (10, 2, 128)])
def test_prefill_attention_is_causal_over_the_whole_context(context: int, chunk: int, heads: int, kv_heads: int,
                                                            hd: int) -> None:
    g = torch.Generator().manual_seed(context)
    k_cache = torch.randn(256, kv_heads, hd, generator=g).bfloat16()
    v_cache = torch.randn(256, kv_heads, hd, generator=g).bfloat16()
    slots = torch.randperm(256, generator=g)[:context]
    qkv = torch.randn(chunk, (heads + 2 * kv_heads) * hd, generator=g).bfloat16()
    q = qkv[:, :heads * hd].view(chunk, heads, hd)  # strided rows, as the model passes them
    out = torch.empty(chunk, heads, hd, dtype=torch.bfloat16)
    cpu_kernels.prefill_attention(q, k_cache, v_cache, slots, 0.2, out)
    keys = k_cache[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [H, C, hd]
    values = v_cache[slots].float().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
    q_pos = torch.arange(context - chunk, context)[:, None]
    allowed = torch.arange(context)[None, :] <= q_pos  # [L, C]
    scores = (q.float().transpose(0, 1) @ keys.transpose(1, 2) * 0.2).masked_fill(~allowed, float("-inf"))
    want = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1)  # [L, H, hd]
    assert (out.float() - want).abs().max() < 1e-2 * want.abs().max()


def _paged_context(context: int, kv_heads: int, hd: int, seed: int, bs: int = 16):
    """Caches with a context of `context` tokens in scattered blocks: (k_cache, v_cache, table, slots)."""
    g = torch.Generator().manual_seed(seed)
    blocks = -(-context // bs) + 2
    k_cache = torch.randn(blocks * bs, kv_heads, hd, generator=g).bfloat16()
    v_cache = torch.randn(blocks * bs, kv_heads, hd, generator=g).bfloat16()
    table = torch.randperm(blocks, generator=g)[:-(-context // bs)]
    slots = torch.tensor([int(table[i // bs]) * bs + i % bs for i in range(context)])
    return k_cache, v_cache, table, slots


# Prefill runs a job per run of rows and KV head (48 query heads a job: 16 rows of 3 heads, 1 row of
# 48 or more), 16 keys a tile; a chunk of several jobs and tiles, and a job of one row, among them.
@pytest.mark.parametrize("context,chunk,heads,kv_heads,hd", [
    (100, 37, 9, 3, 64), (53, 53, 4, 4, 64), (70, 21, 8, 2, 128), (40, 9, 6, 2, 96), (33, 30, 26, 2, 64),
    (300, 211, 9, 3, 64), (45, 7, 48, 1, 32)])
def test_a_query_gets_the_same_bits_in_a_prefill_chunk_as_in_a_decode_step(context: int, chunk: int, heads: int,
                                                                           kv_heads: int, hd: int) -> None:
    """Greedy determinism rests on this: a token's attention output (and so its KV downstream)
    must not depend on whether it came in a prefill chunk, which chunk, or as a decode."""
    k_cache, v_cache, table, slots = _paged_context(context, kv_heads, hd, seed=context + chunk)
    q = torch.randn(chunk, heads, hd, generator=torch.Generator().manual_seed(chunk)).bfloat16()
    prefill = torch.empty(chunk, heads, hd, dtype=torch.bfloat16)
    cpu_kernels.prefill_attention(q, k_cache, v_cache, slots, hd ** -0.5, prefill)
    lens = torch.arange(context - chunk + 1, context + 1)  # query i sees the context up to itself
    decode = cpu_kernels.decode_attention(q, k_cache, v_cache, table.repeat(chunk, 1), lens, 16, hd ** -0.5)
    assert torch.equal(prefill, decode)
    # and in a chunk of its own: the last 5 queries
    tail = torch.empty(5, heads, hd, dtype=torch.bfloat16)
    cpu_kernels.prefill_attention(q[-5:], k_cache, v_cache, slots, hd ** -0.5, tail)
    assert torch.equal(tail, prefill[-5:])


@pytest.mark.skipif(not cpu_build.cpu_has_bf16_dot(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("heads,kv_heads,hd", [(32, 4, 64), (16, 2, 128)])
def test_scores_by_vdpbf16ps_give_the_bits_of_the_fused_multiply_adds(monkeypatch: pytest.MonkeyPatch, heads: int,
                                                                      kv_heads: int, hd: int) -> None:
    """Where the CPU has AVX512-BF16, attention's scores take VDPBF16PS (its pairs' halves swapped, so
    that it adds each pair's products in the order the fused multiply-adds do elsewhere): a token's
    outputs must not depend on which the build used. A score's last bit seldom reaches a bf16 output
    (adding a pair's products in the other order changes about one output in 10^5), hence a
    million outputs of each kernel."""
    context = 600
    k_cache, v_cache, table, slots = _paged_context(context, kv_heads, hd, seed=hd)
    q = (torch.randn(context, heads, hd, generator=torch.Generator().manual_seed(heads)) * 4).bfloat16()
    lens = torch.randint(1, context + 1, (context,), generator=torch.Generator().manual_seed(hd))

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        prefill = torch.empty(context, heads, hd, dtype=torch.bfloat16)
        cpu_kernels.prefill_attention(q, k_cache, v_cache, slots, hd ** -0.5, prefill)
        return prefill, cpu_kernels.decode_attention(q, k_cache, v_cache, table.repeat(context, 1), lens, 16,
                                                     hd ** -0.5)

    assert "-mavx512bf16" in cpu_build.build_flags()
    with_dot = outputs()
    fmas = cpu_kernels.declare(ctypes.CDLL(str(cpu_build._build(cpu_build.build_flags(bf16_dot=False)))))
    monkeypatch.setattr(cpu_kernels, "library", lambda: fmas)
    without = outputs()
    assert torch.equal(with_dot[0], without[0]) and torch.equal(with_dot[1], without[1])


def test_a_compiler_that_refuses_avx512bf16_builds_the_kernels_without_it(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    _stand_in_compiler(monkeypatch, tmp_path, """for arg in "$@"; do  # as GCC before 10 answers the flag
  [ "$arg" = -mavx512bf16 ] && { echo "cc: error: unrecognized command-line option '$arg'" >&2; exit 1; }
done""")
    monkeypatch.setattr(cpu_build, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(cpu_build, "cpu_has_bf16_dot", lambda: True)
    runs_avx512 = cpu_build.cpu_runs_avx512()
    monkeypatch.setattr(cpu_build, "cpu_runs_avx512", lambda: True)
    built = cpu_build.build_for_this_cpu()
    assert built == cpu_build._build(cpu_build.FLAGS) and built.exists()
    assert cpu_kernels.declare(ctypes.CDLL(str(built))).forge_supported() == runs_avx512


def _stand_in_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, before: str) -> None:
    """$CC replaced by a shell script that runs `before` and then the real compiler."""
    compiler = tmp_path / "cc"
    compiler.write_text(f'#!/bin/sh\n{before}\nexec {shutil.which(os.environ.get("CC", "cc"))} "$@"\n')
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))


def _sources(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, texts: dict[str, str]) -> None:
    """cpu_kernels' sources replaced by `texts` (file name -> C), built into a cache under tmp_path."""
    (tmp_path / "src").mkdir()
    for name, text in texts.items():
        (tmp_path / "src" / name).write_text(text)
    (tmp_path / "src" / cpu_build.AVX2_HEADER).write_text("")
    monkeypatch.setattr(cpu_build, "SOURCES", sorted((tmp_path / "src").glob("*.c")))
    monkeypatch.setattr(cpu_build, "CACHE_DIR", tmp_path / "cache")


def test_sources_compiled_apart_link_the_library_one_command_builds(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    _sources(monkeypatch, tmp_path, {"a.c": "int forge_a(int x) { return 3 * x; }\n",
                                     "b.c": "int forge_a(int);\nint forge_b(int x) { return forge_a(x) + 1; }\n"})
    flags = ["-O2", "-std=c11", "-fopenmp", "-fPIC", "-shared"]  # every build links libgomp
    built = cpu_build._build(flags)
    assert built.parent == tmp_path / "cache" and cpu_build._build(flags) == built  # cached
    assert ctypes.CDLL(str(built)).forge_b(4) == 13
    whole = tmp_path / "whole.so"  # the single command the objects stand in for
    compiler = os.environ.get("CC", "cc")
    subprocess.run([compiler, *flags, *map(str, cpu_build.SOURCES), "-o", str(whole)], check=True)
    assert built.read_bytes() == whole.read_bytes()


def test_the_sources_compile_at_once(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _sources(monkeypatch, tmp_path, {f"{name}.c": f"int forge_{name}(void) {{ return 1; }}\n" for name in "abc"})
    marks = tmp_path / "marks"
    marks.mkdir()
    # each compile waits (5 s at most) until all three have started
    _stand_in_compiler(monkeypatch, tmp_path, f"""case " $* " in *" -c "*)
  touch "{marks}/$$"; n=0
  while [ "$(ls "{marks}" | wc -l)" -lt 3 ]; do
    sleep 0.05; n=$((n + 1)); [ $n -gt 100 ] && {{ echo "compiled alone" >&2; exit 1; }}
  done;;
esac""")
    built = cpu_build._build(["-O2", "-std=c11", "-fopenmp", "-fPIC", "-shared"])
    assert len(list(marks.iterdir())) == 3 and ctypes.CDLL(str(built)).forge_c() == 1


def test_a_header_the_sources_include_is_part_of_the_build_s_cache_key(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    _sources(monkeypatch, tmp_path, {"a.c": '#include "k.h"\nint forge_a(void) { return K; }\n'})
    header = tmp_path / "src" / "k.h"
    flags = ["-O2", "-std=c11", "-fPIC", "-shared"]
    header.write_text("#define K 3\n")
    first = cpu_build._build(flags)
    header.write_text("#define K 4\n")  # the source unchanged: only the header says what it builds
    second = cpu_build._build(flags)
    assert second != first and ctypes.CDLL(str(second)).forge_a() == 4


def test_a_source_that_does_not_compile_fails_the_build_with_its_error(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    _sources(monkeypatch, tmp_path, {"a.c": "int forge_a(void) { return 1; }\n",
                                     "b.c": "int forge_b(void) { return nothing_here; }\n"})
    with pytest.raises(subprocess.CalledProcessError) as failed:
        cpu_build._build(["-O2", "-std=c11", "-fPIC", "-shared"])
    assert "b.c" in " ".join(failed.value.cmd) and "nothing_here" in failed.value.stderr
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing cached, and the directory left clean
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]


def _refined(logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    out = logits.clone()
    cpu_kernels.refine_top_(out, h, weight, k)
    return out


def test_refine_top_recomputes_each_row_s_largest_logits_in_fp32() -> None:
    g = torch.Generator().manual_seed(7)
    vocab, dim, k = 1000, 104, 8  # 104: a ragged tail of 8 past 16-lane vectors
    weight = torch.randn(vocab, dim, generator=g).bfloat16()
    h = torch.randn(5, dim, generator=g)
    logits = torch.randn(5, vocab, generator=g)
    got = _refined(logits, h, weight, k)
    for r in range(5):
        top = torch.topk(logits[r], k).indices
        assert set((got[r] != logits[r]).nonzero().flatten().tolist()) == set(top.tolist())
        exact = weight[top].double() @ h[r].double()
        assert torch.allclose(got[r, top].double(), exact, rtol=1e-5, atol=1e-5)
    reference = logits.clone()
    torch_ref.refine_leaders(reference, h, weight, k)  # the other backends' way: the same logits, to rounding
    assert torch.allclose(got, reference, rtol=1e-5, atol=1e-5)
    # a row's result depends on that row alone
    assert torch.equal(_refined(logits[3:4], h[3:4], weight, k)[0], got[3])


def test_refine_top_takes_the_lower_index_among_equal_logits() -> None:
    g = torch.Generator().manual_seed(8)
    weight = torch.randn(1000, 64, generator=g).bfloat16()
    h = torch.randn(1, 64, generator=g)
    logits = torch.zeros(1, 1000)
    logits[0, [900, 3, 17, 600, 42, 250, 128, 64, 7]] = 1.0
    logits[0, 999] = 2.0  # last: it pushes out the highest index of the eight ones before it
    got = _refined(logits, h, weight, 8)
    assert sorted((got[0] != logits[0]).nonzero().flatten().tolist()) == [3, 7, 17, 42, 64, 128, 250, 999]


def test_int8_quantisation_in_runs_of_rows_equals_it_in_one(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = (torch.randn(1000, 96) * torch.rand(1000, 1) * 4).to(torch.bfloat16)
    weight[7, :32] = 0  # a zero group: scale 0, codes 0
    whole = Int8Weight.quantize(weight)
    monkeypatch.setattr(base, "QUANTIZE_ROWS", 96)  # 11 runs, the last short
    runs = Int8Weight.quantize(weight)
    assert torch.equal(runs.codes, whole.codes) and torch.equal(runs.scale, whole.scale)
    assert (whole.scale[7, 0], whole.codes[7, :32].abs().max()) == (0, 0)


def _split(lens: list[int], tables: list[list[int]], threads: int, chunks: tuple[tuple[int, int], ...] = (),
           row_keys: float = 768.0) -> list[int]:
    """forge_split_rows's runs of a step's rows: decode rows (their context lengths and block tables),
    then prefill chunks of (rows, context length)."""
    t = torch.tensor(tables or [[0]], dtype=torch.int64)
    n = torch.tensor(lens or [0], dtype=torch.int32)
    k, first = [], len(lens)
    for rows, context in chunks:
        k.append([first, rows, context])
        first += rows
    c = torch.tensor(k or [[0, 0, 0]], dtype=torch.int64)
    bounds = torch.zeros(9, dtype=torch.int64)
    parts = cpu_kernels.library().forge_split_rows(first, len(lens), t.data_ptr(), t.shape[1], n.data_ptr(),
                                                   len(chunks), c.data_ptr(), row_keys, threads, bounds.data_ptr())
    return bounds[:parts + 1].tolist() if parts > 1 else []


def _sequences(rows: list[int]) -> tuple[list[int], list[list[int]]]:
    """Decode rows of sequences with the given row counts (1: a plain decode, more: drafts): each
    sequence its own block, its rows' lengths one apart."""
    lens, tables = [], []
    for s, count in enumerate(rows):
        lens += [20 + s + i for i in range(count)]
        tables += [[s + 1, 0]] * count
    return lens, tables


@pytest.mark.skipif(cpu_kernels.library() is None, reason="needs the native kernels")
def test_a_step_splits_by_rows_between_threads_between_sequences_and_in_chunks() -> None:
    assert _split(*_sequences([1] * 16), threads=2) == [0, 8, 16]
    assert _split(*_sequences([1] * 17), threads=2) == [0, 9, 17]  # the nearer to even cost
    assert _split(*_sequences([1] * 9), threads=2) == [0, 5, 9]  # past one GEMM block of 8 rows, 4 or more a thread
    assert _split(*_sequences([1] * 8), threads=2) == []  # one block: by weight tiles
    assert _split(*_sequences([1] * 32), threads=1) == []
    assert _split(*_sequences([1] * 40), threads=4) == [0, 10, 20, 30, 40]
    assert _split(*_sequences([1] * 40), threads=16) == []  # many threads: by weight tiles
    # A drafted sequence's rows (9 .. 12) read each other's keys: the split falls beside them,
    # at the nearest sequence start that leaves each side 4 rows.
    assert _split(*_sequences([1] * 9 + [4] + [1] * 7), threads=2) == [0, 9, 20]
    assert _split(*_sequences([1] * 8 + [3] + [1] * 9), threads=2) == [0, 11, 20]
    assert _split(*_sequences([1] * 3 + [11] + [1] * 3), threads=2) == []  # no such start
    assert _split(*_sequences([1] * 4 + [9] + [1] * 4), threads=2) == [0, 13, 17]  # the nearer of 4 and 13
    # Rows of one table with lengths one apart are one sequence; otherwise each its own.
    assert _split([5] * 16, [[1, 0]] * 16, threads=2) == [0, 8, 16]
    assert _split(list(range(5, 21)), [[1, 0]] * 16, threads=2) == []
    # Rows weigh their projections (row_keys) and the keys they attend to: 16 rows of 1,000 keys
    # and 32 of 10, where each row's projections are worth 100 keys, split after 10 rows, not 24.
    assert _split([1000] * 16 + [10] * 32, [[s, 0] for s in range(48)], threads=2, row_keys=100.0) == [0, 10, 48]
    # A chunk splits anywhere: 7 decode rows and a chunk of 121 rows, the first of a 121-token prompt.
    # Its later rows attend to more keys, so the first thread takes more rows.
    bounds = _split(*_sequences([1] * 7), threads=2, chunks=((121, 121),))
    assert len(bounds) == 3 and 128 // 2 < bounds[1] < 128 - 4
    assert _split([], [], threads=2, chunks=((8, 8), (8, 100))) == [0, 8, 16]  # between chunks
    assert _split([], [], threads=2, chunks=((7, 7),)) == []


@pytest.mark.parametrize("bits", [4, 8])
def test_extreme_codes_against_extreme_activations_are_summed_exactly(bits: int) -> None:
    """Every product at its largest: q4 codes of 15 and q8 codes of -128 and 127 against activations
    quantised to +-127. The integer dots must not saturate anywhere (the AVX2 build's 16-bit pairs of
    products are where they could): the output is the exact sum of the weights' signed values."""
    n, k = 32, 576
    signs = torch.where(torch.rand(3, k, generator=torch.Generator().manual_seed(bits)) < 0.5, -1.0, 1.0)
    if bits == 4:
        codes = torch.full((n, k), 15, dtype=torch.uint8)
        codes[1::2, ::3] = 0
        scale = torch.ones(n, k // 32)
        w = cpu_kernels.pack_q4(codes, scale, 8 * scale)  # w = code
    else:  # rows of 127, of -128, of both in turn, and random codes
        codes = torch.randint(-128, 128, (n, k), generator=torch.Generator().manual_seed(n), dtype=torch.int8)
        codes[0::4], codes[1::4] = 127, -128
        codes[2::4] = torch.where(torch.arange(k) % 2 == 0, -128, 127).to(torch.int8)
        w = cpu_kernels.pack_q8_codes(Int8Weight(codes, torch.ones(n, k // 32)))
    values = codes.double()
    x = torch.cat([torch.ones(1, k), -torch.ones(1, k), signs])  # each value its group's largest: exactly +-127
    x[3] = torch.where(values[1] < 0, -1.0, 1.0)  # every product of row 1 positive and at its largest
    exact = x.double() @ values.T
    for levels in (1, 2):
        got = cpu_kernels.linear(x, w, levels)
        assert torch.allclose(got.double(), exact, rtol=1e-6, atol=1e-3), levels


@pytest.mark.skipif(not cpu_build.cpu_runs_avx512(),
                    reason="compares the AVX2 build with the AVX-512 one, which this CPU cannot run")
def test_the_avx2_build_gives_the_bits_of_the_avx512_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The two builds of the kernels (see native/cpu/avx2.h) give the same bits on every kernel, so
    that a CPU's answers do not depend on which of them it runs."""
    from forge_service.backends.torch_ref import rotary_tables
    from forge_service.layers.rotary import RotaryEmbedding

    avx512, avx2 = (cpu_kernels.declare(ctypes.CDLL(str(cpu_build._build(cpu_build.build_flags(avx512=wide)))))
                    for wide in (True, False))
    g = torch.Generator().manual_seed(11)
    codes, scale, zero = _codes(960, 576, seed=5)
    weights = [cpu_kernels.pack_q4(codes, scale, zero), cpu_kernels.pack_q8(torch.randn(960, 576, generator=g) * 0.05)]
    activations = [_with_outliers(rows, 576, seed=rows) for rows in (1, 9, 64, 200)]
    residual, delta = torch.randn(40, 576, generator=g) * 3, torch.randn(40, 576, generator=g).bfloat16()
    norm_weight = (torch.rand(576, generator=g) + 0.5).bfloat16()
    gate_up = (torch.randn(40, 2 * 1536, generator=g) * 4).bfloat16()
    rope = RotaryEmbedding(64, 4096, 10000.0)
    cos, sin = rotary_tables(rope.cos, rope.sin, torch.arange(0, 4000, 100), torch.bfloat16)
    qk = (torch.randn(40, 12, 64, generator=g) * 3).bfloat16()
    decode_case = paged_attention_case(9, 3, 64, [1, 17, 100, 33, 250])
    k_cache, v_cache, _, slots = _paged_context(300, 2, 64, seed=3)
    queries = (torch.randn(300, 8, 64, generator=g) * 4).bfloat16()
    logits, h = torch.randn(5, 1000, generator=g), torch.randn(5, 104, generator=g)
    head = torch.randn(1000, 104, generator=g).bfloat16()

    def outputs() -> list[torch.Tensor]:
        got = [cpu_kernels.linear(x.to(dtype), w, levels)
               for w in weights for x in activations for dtype in (torch.float32, torch.bfloat16) for levels in (1, 2)]
        stream = residual.clone()
        got += [cpu_kernels.add_rms_norm(stream, delta, norm_weight, 1e-5), stream]
        got += [*cpu_kernels.final_norm(residual, delta, torch.tensor([39, 0, 17]), norm_weight.float(), 1e-5)]
        got.append(cpu_kernels.silu_mul(gate_up))
        rotated, normed = qk.clone(), qk.clone()
        cpu_kernels.rotary_(rotated, cos, sin)
        cpu_kernels.head_rms_norm_(normed, 8, norm_weight[:64], norm_weight[64:128], 1e-6)
        got += [rotated, normed, cpu_kernels.decode_attention(*decode_case, PAGED_BLOCK, 64 ** -0.5)]
        prefill = torch.empty(300, 8, 64, dtype=torch.bfloat16)
        cpu_kernels.prefill_attention(queries, k_cache, v_cache, slots, 0.125, prefill)
        got.append(prefill)
        got.append(_refined(logits, h, head, 8))
        return got

    monkeypatch.setattr(cpu_kernels, "library", lambda: avx512)
    wanted = outputs()
    monkeypatch.setattr(cpu_kernels, "library", lambda: avx2)
    for i, (got, want) in enumerate(zip(outputs(), wanted, strict=True)):
        assert torch.equal(got, want), i


def test_a_cpu_without_avx2_keeps_torch_s_kernels_without_building(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build(flags: list[str]) -> Path:
        raise AssertionError(f"built with {flags}")

    monkeypatch.setattr(cpu_build, "_build", no_build)
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: frozenset({"sse2", "avx", "fma", "f16c"}))
    cpu_kernels.library.cache_clear()
    try:
        assert cpu_kernels.library() is None
    finally:
        cpu_kernels.library.cache_clear()
