"""Typed wrapper for native/prefill_attention.cu: varlen prefill attention over the paged cache."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from forge_service.backends.cuda.launch import Kernels, check_caches, check_tensor, cxx, f32, i32, i64, ptr, require

SOURCE = "prefill_attention.cu"
ROWS = 64  # (token, head) rows per tile: kRows in the kernel
THREADS = 128
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)


def block_n(head_dim: int) -> int:
    """Keys per tile: 32 at head_dim 256 keeps shared memory within an A100's 163 KB."""
    return 32 if head_dim > 128 else 64


def smem_bytes(dtype: torch.dtype, head_dim: int) -> int:
    """Dynamic shared memory of one CTA; mirrors PrefillSmem in the kernel."""
    e, n = torch.finfo(dtype).bits // 8, block_n(head_dim)
    ld_x, ld_s, ld_p, ld_o = head_dim + 16 // e, n + 4, n + 8, head_dim + 4
    return (ROWS * ld_x + 2 * n * ld_x) * e + ROWS * ld_s * 4 + ROWS * ld_p * e + ROWS * ld_o * 4


def tokens_per_tile(group: int) -> int:
    return ROWS // group


def name(dtype: torch.dtype, head_dim: int, group: int) -> str:
    return f"forge::paged_prefill_kernel<{cxx(dtype)}, {head_dim}, {group}, {block_n(head_dim)}>"


def ci_names() -> tuple[str, ...]:
    return tuple(name(t, hd, g) for t in DTYPES for hd, g in [(64, 3), (128, 4), (128, 8), (256, 1)])


@dataclass
class PrefillBatch:
    """The prefill chunks of one step, on the device: per chunk its first row in q, length,
    context length after the chunk and block table; and the (chunk, first token) of each tile."""

    q_start: torch.Tensor  # [P] int32
    q_len: torch.Tensor  # [P] int32
    ctx_len: torch.Tensor  # [P] int32
    block_tables: torch.Tensor  # [P, W] int32
    tiles: torch.Tensor  # [num_tiles, 2] int32


def build_tiles(q_lens: list[int], group: int) -> list[tuple[int, int]]:
    step = tokens_per_tile(group)
    return [(c, t) for c, n in enumerate(q_lens) for t in range(0, n, step)]


def paged_prefill(kernels: Kernels, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  batch: PrefillBatch, block_size: int, scale: float) -> None:
    """out: [T, H * hd] (rows of every chunk written); q: [T, H, hd]; caches: [S, Hkv, hd]."""
    t, h, hd = q.shape
    hkv = k_cache.shape[1]
    require(q.dtype in DTYPES and hd in HEAD_DIMS, f"CUDA prefill attention takes {DTYPES} with head_dim in "
                                                   f"{HEAD_DIMS}, not {q.dtype} / {hd}")
    require(h % hkv == 0 and h // hkv <= ROWS, f"{h} heads do not group over {hkv} KV heads")
    check_tensor(q, "q", DTYPES, 3)
    require(q.stride(1) == hd, "q heads must be dense")
    check_tensor(out, "out", (q.dtype,), 2)
    require(out.shape == (t, h * hd), f"out {tuple(out.shape)} must be [{t}, {h * hd}]")
    check_caches(k_cache, v_cache, q.dtype)
    require(k_cache.shape[2] == hd, f"cache head_dim {k_cache.shape[2]} differs from q's {hd}")
    for field in ("q_start", "q_len", "ctx_len", "block_tables", "tiles"):
        tensor = getattr(batch, field)
        check_tensor(tensor, field, (torch.int32,), tensor.dim(), aligned=False)
        require(tensor.is_contiguous(), f"{field} must be contiguous")
    kernel = kernels.get(SOURCE, name(q.dtype, hd, h // hkv))
    kernel((batch.tiles.shape[0], hkv), THREADS, [
        ptr(out), ptr(q), ptr(k_cache), ptr(v_cache), ptr(batch.block_tables), ptr(batch.q_start), ptr(batch.q_len),
        ptr(batch.ctx_len), ptr(batch.tiles), i32(batch.block_tables.stride(0)), i32(block_size), i32(hkv),
        i64(q.stride(0)), i64(out.stride(0)), f32(scale * math.log2(math.e))], smem=smem_bytes(q.dtype, hd))
