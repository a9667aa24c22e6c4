"""Typed wrapper for native/decode_attention.cu: paged decode attention with split-KV."""
from __future__ import annotations

import math

import torch

from forge_service.backends.cuda.launch import Kernels, check_caches, check_tensor, cxx, f32, i32, i64, ptr, require

SOURCE = "decode_attention.cu"
NUM_WARPS = 4
REDUCE_BLOCK = 128
MAX_GROUP = 8
MIN_PART = 256  # positions of a part of a row's context, at least (one CTA's pass)
MAX_PARTS = 32  # parts of one row, at most
HEAD_DIMS = {torch.float32: (64, 128), torch.float16: (64, 128, 256), torch.bfloat16: (64, 128, 256)}


def split_parts(length: int, min_part: int = MIN_PART, max_parts: int = MAX_PARTS) -> tuple[int, int]:
    """How the kernel cuts a context of `length` positions (split_parts in decode_attention.cu):
    (positions per part, parts), per part max(min_part, ceil(length / max_parts)). Each part is one
    CTA's pass and the parts are combined in order, so a row's bits depend on its own length alone,
    never on the batch it runs in (greedy determinism)."""
    per_part = max(min_part, -(-length // max_parts))
    return per_part, max(1, -(-length // per_part))


def grid_parts(max_len: int, min_part: int = MIN_PART, max_parts: int = MAX_PARTS) -> int:
    """Split CTAs per (row, KV head) for rows of up to `max_len` positions: the most parts of any of
    them, min(max_parts, ceil(max_len / min_part)); a row's CTAs past its own parts return at once.
    Fixed by max_len alone, so a captured graph serves any lengths up to it. (Past min_part x
    max_parts positions a length may have fewer parts than a shorter one where min_part <
    max_parts: hence not max_len's own count.)"""
    return max(1, min(max_parts, -(-max_len // min_part)))


def decode_name(dtype: torch.dtype, head_dim: int, group: int) -> str:
    unroll = 4 if group <= 4 else 2  # keeps the GROUP x Vec accumulators in registers
    return f"forge::paged_decode_kernel<{cxx(dtype)}, {head_dim}, {group}, {NUM_WARPS}, {unroll}>"


def reduce_name(dtype: torch.dtype) -> str:
    return f"forge::reduce_splits_kernel<{cxx(dtype)}, {REDUCE_BLOCK}>"


def ci_names() -> tuple[str, ...]:
    shapes = {torch.float32: [(64, 3), (128, 4)],
              torch.float16: [(64, 3), (128, 4), (128, 8), (256, 1)],
              torch.bfloat16: [(64, 3), (128, 4), (128, 8), (256, 1)]}
    return tuple(n for t, s in shapes.items() for n in [*(decode_name(t, hd, g) for hd, g in s), reduce_name(t)])


def check_shape(dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    """Raise InvalidArgument for a model these kernels have no instantiation for."""
    require(dtype in HEAD_DIMS and head_dim in HEAD_DIMS[dtype],
            f"CUDA decode attention supports head_dim {HEAD_DIMS.get(dtype)} in {dtype}, not {head_dim}")
    require(num_heads % num_kv_heads == 0 and num_heads // num_kv_heads <= MAX_GROUP,
            f"{num_heads} query heads over {num_kv_heads} KV heads: groups of at most {MAX_GROUP} are supported")


def paged_decode(kernels: Kernels, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, max_len: int, scale: float, *,
                 min_part: int = MIN_PART, max_parts: int = MAX_PARTS) -> None:
    """out: [D, H * hd] rows; q: [D, H, hd]; caches: [S, Hkv, hd]; block_tables: [D, W] int32;
    seq_lens: [D] int32 (0 for padding rows, whose output is zeros), none above max_len."""
    d, h, hd = q.shape
    hkv = k_cache.shape[1]
    check_shape(q.dtype, h, hkv, hd)
    check_tensor(q, "q", (q.dtype,), 3)
    require(q.stride(1) == hd, "q heads must be dense")
    check_tensor(out, "out", (q.dtype,), 2)
    require(out.shape == (d, h * hd), f"out {tuple(out.shape)} must be [{d}, {h * hd}]")
    check_caches(k_cache, v_cache, q.dtype)
    require(k_cache.shape[2] == hd, f"cache head_dim {k_cache.shape[2]} differs from q's {hd}")
    check_tensor(block_tables, "block_tables", (torch.int32,), 2, aligned=False)
    check_tensor(seq_lens, "seq_lens", (torch.int32,), 1, aligned=False)
    require(block_tables.shape[0] == d and seq_lens.shape == (d,), "one block table and length per row")
    require(min_part > 0 and max_parts > 0, "min_part and max_parts must be positive")
    group = h // hkv
    num_splits = grid_parts(max_len, min_part, max_parts)
    split = num_splits > 1
    part_out = torch.empty(d, h, num_splits, hd, dtype=torch.float32, device=q.device) if split else out
    part_lse = torch.empty(d, h, num_splits, dtype=torch.float32, device=q.device) if split else out
    kernels.get(SOURCE, decode_name(q.dtype, hd, group))((d, hkv, num_splits), NUM_WARPS * 32, [
        ptr(out), ptr(part_out), ptr(part_lse), ptr(q), ptr(k_cache), ptr(v_cache), ptr(block_tables), ptr(seq_lens),
        i32(block_tables.stride(0)), i32(block_size), i32(hkv), i64(q.stride(0)), i64(out.stride(0)),
        i32(min_part), i32(max_parts), f32(scale * math.log2(math.e))])
    if split:
        kernels.get(SOURCE, reduce_name(q.dtype))((d, h), REDUCE_BLOCK, [
            ptr(out), ptr(part_out), ptr(part_lse), ptr(seq_lens), i32(num_splits), i32(min_part), i32(max_parts),
            i32(hd), i64(out.stride(0))])
