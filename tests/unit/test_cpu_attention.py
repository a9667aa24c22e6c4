"""CPU paged attention against a naive per-sequence reference, fp32 and bf16."""
from __future__ import annotations

import pytest
import torch

from forge_service.backends.base import AttentionMetadata, PrefillSeq
from forge_service.backends.cpu import CpuBackend

BS, HKV, H, HD = 4, 2, 6, 8


def naive(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    # q: [L, H, hd]; keys/values: [C, Hkv, hd]; query i sees keys 0..q_pos[i]
    g = H // HKV
    k = keys.float().repeat_interleave(g, dim=1)
    v = values.float().repeat_interleave(g, dim=1)
    s = torch.einsum("lhd,chd->hlc", q.float(), k) * HD ** -0.5
    s = s.masked_fill(torch.arange(len(keys))[None, None, :] > q_pos[None, :, None], float("-inf"))
    return torch.einsum("hlc,chd->lhd", s.softmax(-1), v)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_mixed_batch_of_decodes_and_prefill_chunks(dtype, tol):
    g = torch.Generator().manual_seed(0)
    num_blocks = 32
    k_cache = torch.randn(num_blocks * BS, HKV, HD, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * BS, HKV, HD, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    # three decodes with ragged contexts (crossing block boundaries) and one prefill chunk at 5..11
    lens = [1, 6, 9]
    tables = [perm[0:1], perm[1:3], perm[3:6]]
    chunk_table, start, end = perm[6:9], 5, 11

    def slots(table, n):
        return torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])

    q = torch.randn(len(lens) + end - start, H, HD, generator=g).to(dtype)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), block_size=BS, num_decode_tokens=len(lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        decode_mask=(torch.arange(width * BS)[None] < torch.tensor(lens)[:, None])[:, None, None, :],
        decode_lens=torch.tensor(lens, dtype=torch.int32),
        prefills=[PrefillSeq(3, 3 + end - start, ctx_slots=slots(chunk_table, end),
                             mask=torch.arange(end)[None] <= torch.arange(start, end)[:, None])],
    )
    out = CpuBackend.attention(q, None, None, k_cache, v_cache, meta, HD ** -0.5).view(-1, H, HD)
    for i, (n, t) in enumerate(zip(lens, tables)):
        s = slots(t, n)
        ref = naive(q[i:i + 1], k_cache[s], v_cache[s], torch.tensor([n - 1]))
        torch.testing.assert_close(out[i:i + 1].float(), ref, atol=tol, rtol=tol)
    s = slots(chunk_table, end)
    ref = naive(q[3:], k_cache[s], v_cache[s], torch.arange(start, end))
    torch.testing.assert_close(out[3:].float(), ref, atol=tol, rtol=tol)
    assert not out.isnan().any()
