"""GPU: paged decode (every split count) and varlen prefill attention against the CPU backend.

The GPU caches hold NaN in every slot no sequence owns, so a kernel that reads past a
sequence's blocks (or a padded block-table entry) produces NaN; the CPU reference gets the same
caches with those slots zeroed.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from forge_service.backends.base import AttentionMetadata, PrefillSeq
from forge_service.backends.cpu import CpuBackend
from forge_service.backends.cuda import decode_attention
from forge_service.backends.cuda.metadata import ModelShape, prepare
from tests.kernels.helpers import assert_close, poison_allocator

pytestmark = pytest.mark.gpu
BS = 16
SHAPES = [(9, 3, 64), (32, 8, 128), (16, 2, 128), (4, 4, 256)]  # (heads, kv_heads, head_dim)
DECODE_LENS = [1, BS - 1, BS, BS + 1, 3 * BS, 100, 1000]


@dataclass
class Cache:
    """Paged caches with NaN in unowned slots (GPU) and zeros there (the CPU reference's copy)."""

    k: torch.Tensor
    v: torch.Tensor
    k_ref: torch.Tensor
    v_ref: torch.Tensor
    tables: list[list[int]]  # per sequence, its blocks


def build_cache(lens: list[int], kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int = 0) -> Cache:
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    num_blocks = sum(need) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, used = [], torch.zeros(num_blocks * BS, dtype=torch.bool)
    for n, blocks in zip(lens, need):
        table, order = order[:blocks], order[blocks:]
        tables.append(table)
        used[[b * BS + p % BS for p in range(n) for b in [table[p // BS]]]] = True
    shape = (num_blocks * BS, kv_heads, head_dim)
    k, v = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
    unowned = ~used[:, None, None]
    k_ref, v_ref = k.masked_fill(unowned, 0), v.masked_fill(unowned, 0)
    nan = float("nan")
    return Cache(k_ref.masked_fill(unowned, nan).cuda(), v_ref.masked_fill(unowned, nan).cuda(), k_ref, v_ref, tables)


def slots(table: list[int], n: int) -> torch.Tensor:
    return torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])


def decode_meta(cache: Cache, lens: list[int]) -> AttentionMetadata:
    """As the model runner builds it: tables padded with block 0, a mask of each row's length."""
    width = max(len(t) for t in cache.tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in cache.tables])
    mask = torch.arange(width * BS)[None] < torch.tensor(lens)[:, None]
    return AttentionMetadata(slot_mapping=torch.zeros(len(lens), dtype=torch.long), block_size=BS,
                             num_decode_tokens=len(lens), decode_block_tables=tables,
                             decode_mask=mask[:, None, None, :], decode_lens=torch.tensor(lens, dtype=torch.int32))


def reference(cache: Cache, q: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """CpuBackend.attention in float32 on the zero-filled copy of the caches."""
    return CpuBackend.attention(q.float(), None, None, cache.k_ref.float(), cache.v_ref.float(), meta, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_decode_matches_cpu(cuda_backend, dtype, heads, kv_heads, head_dim):
    if head_dim not in decode_attention.HEAD_DIMS[dtype]:
        pytest.skip(f"no {dtype} decode kernel for head_dim {head_dim}")
    cache = build_cache(DECODE_LENS, kv_heads, head_dim, dtype, seed=head_dim)
    q = torch.randn(len(DECODE_LENS), heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dtype)
    meta = decode_meta(cache, DECODE_LENS)
    scale = head_dim ** -0.5
    want = reference(cache, q, meta, scale)
    cmeta = prepare(meta, ModelShape(kv_heads, heads // kv_heads, dtype), cuda_backend.device)
    # The 1000-token row in 1, 7 and 32 parts (of 1024, 143 and 32 positions), and as served.
    cuts = {(1024, 32), (16, 7), (16, 32), (decode_attention.MIN_PART, decode_attention.MAX_PARTS)}
    for min_part, max_parts in sorted(cuts):
        poison_allocator()
        out = torch.full((len(DECODE_LENS), heads * head_dim), float("nan"), dtype=dtype, device="cuda")
        decode_attention.paged_decode(cuda_backend.kernels, out, q.cuda(), cache.k, cache.v, cmeta.decode_tables,
                                      cmeta.decode_lens, BS, cmeta.decode_max_len, scale, min_part=min_part,
                                      max_parts=max_parts)
        assert_close(out, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_decode_row_has_the_same_bits_alone_and_in_any_batch(cuda_backend, dtype):
    """Where a row's context is cut into parts depends on its own length only: alone, or beside
    more and longer rows (a larger grid), it gets the same bits. Greedy determinism on the GPU
    rests on it: a request's tokens must not depend on what else the server runs."""
    heads, kv_heads, head_dim = 32, 8, 128
    lens = [*DECODE_LENS, 5000, 2500]
    cache = build_cache(lens, kv_heads, head_dim, dtype, seed=7)
    q = torch.randn(len(lens), heads, head_dim, generator=torch.Generator().manual_seed(3)).to(dtype).cuda()
    meta = prepare(decode_meta(cache, lens), ModelShape(kv_heads, heads // kv_heads, dtype), cuda_backend.device)
    together = torch.empty(len(lens), heads * head_dim, dtype=dtype, device="cuda")
    decode_attention.paged_decode(cuda_backend.kernels, together, q, cache.k, cache.v, meta.decode_tables,
                                  meta.decode_lens, BS, meta.decode_max_len, head_dim ** -0.5)
    for i, n in enumerate(lens):
        table = torch.tensor([cache.tables[i]], dtype=torch.int32, device="cuda")
        for max_len in (table.shape[1] * BS, 32_768):  # its own grid, and the grid of a graph's longest context
            alone = torch.empty(1, heads * head_dim, dtype=dtype, device="cuda")
            decode_attention.paged_decode(cuda_backend.kernels, alone, q[i:i + 1], cache.k, cache.v, table,
                                          meta.decode_lens[i:i + 1], BS, max_len, head_dim ** -0.5)
            assert torch.equal(alone[0], together[i]), f"row {i} ({n} positions), grid for {max_len}"


def test_decode_padding_rows_are_zero(cuda_backend):
    cache = build_cache([5, 40], 2, 128, torch.bfloat16)
    q = torch.randn(3, 8, 128, dtype=torch.bfloat16, device="cuda")
    tables = torch.tensor([cache.tables[0] + [0, 0], cache.tables[1], [0, 0, 0]], dtype=torch.int32, device="cuda")
    lens = torch.tensor([5, 40, 0], dtype=torch.int32, device="cuda")
    for min_part in (64, 8):  # the 40-token row whole, and in 5 parts
        out = torch.full((3, 8 * 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        decode_attention.paged_decode(cuda_backend.kernels, out, q, cache.k, cache.v, tables, lens, BS, 3 * BS, 0.1,
                                      min_part=min_part)
        assert not out.isnan().any()
        assert (out[2] == 0).all()


def mixed_batch(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Two decodes, a chunk over cached context (positions 37..100) and a first chunk (0..49)."""
    decode_lens = [17, 64]
    chunks = [(37, 101), (0, 50)]  # (start, end) positions
    cache = build_cache(decode_lens + [end for _, end in chunks], kv_heads, head_dim, dtype, seed=head_dim + 1)
    meta = decode_meta(Cache(cache.k, cache.v, cache.k_ref, cache.v_ref, cache.tables[:2]), decode_lens)
    row, slot_rows = len(decode_lens), [torch.zeros(len(decode_lens), dtype=torch.long)]
    for (start, end), table in zip(chunks, cache.tables[2:]):
        seq = PrefillSeq(row, row + end - start)
        ctx = slots(table, end)
        if start:
            seq.ctx_slots = ctx
            seq.mask = torch.arange(end)[None] <= torch.arange(start, end)[:, None]
        slot_rows.append(ctx[start:])
        meta.prefills.append(seq)
        row += end - start
    meta.slot_mapping = torch.cat(slot_rows)
    q = torch.randn(row, heads, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    return cache, meta, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", SHAPES)
def test_mixed_decode_and_prefill_batch_matches_cpu(cuda_backend, dtype, heads, kv_heads, head_dim):
    if head_dim not in decode_attention.HEAD_DIMS[dtype]:
        pytest.skip(f"no {dtype} decode kernel for head_dim {head_dim}")
    cache, meta, q = mixed_batch(heads, kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    # The chunks' own K/V: the CPU reference reads them from k, v when a chunk starts at 0.
    k = cache.k_ref[meta.slot_mapping].float()
    v = cache.v_ref[meta.slot_mapping].float()
    want = CpuBackend.attention(q.float(), k, v, cache.k_ref.float(), cache.v_ref.float(), meta, scale)
    cmeta = prepare(meta, ModelShape(kv_heads, heads // kv_heads, dtype), cuda_backend.device)
    poison_allocator()
    got = cuda_backend.attention(q.cuda(), k.to(dtype).cuda(), v.to(dtype).cuda(), cache.k, cache.v, cmeta, scale)
    # P is rounded to the 16-bit dtype before P @ V on tensor cores, as flash attention does.
    assert_close(got, want, dtype, scale=1.0 if dtype == torch.float32 else 2.0)


def test_prefill_tiles_cover_every_row(cuda_backend):
    """A long chunk whose length is no multiple of the tile (64 // 3 = 21 tokens per tile)."""
    heads, kv_heads, head_dim, n = 9, 3, 64, 21 * 5 + 4
    cache = build_cache([n], kv_heads, head_dim, torch.bfloat16, seed=9)
    meta = AttentionMetadata(slot_mapping=slots(cache.tables[0], n), block_size=BS, num_decode_tokens=0,
                             prefills=[PrefillSeq(0, n)])
    q = torch.randn(n, heads, head_dim, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    k, v = cache.k_ref[meta.slot_mapping].float(), cache.v_ref[meta.slot_mapping].float()
    want = CpuBackend.attention(q.float(), k, v, cache.k_ref.float(), cache.v_ref.float(), meta, 0.125)
    cmeta = prepare(meta, ModelShape(kv_heads, 3, torch.bfloat16), cuda_backend.device)
    poison_allocator()
    got = cuda_backend.attention(q.cuda(), None, None, cache.k, cache.v, cmeta, 0.125)
    assert_close(got, want, torch.bfloat16, scale=2.0)
