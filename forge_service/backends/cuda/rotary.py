"""Typed wrapper for native/rotary.cu: rotary embedding of q and k in place, by position."""
from __future__ import annotations

import torch

from forge_service.backends.cuda.launch import FLOAT_DTYPES, Kernels, check_tensor, cxx, i32, i64, ptr, require

SOURCE = "rotary.cu"
BLOCK = 128


def name(dtype: torch.dtype) -> str:
    return f"forge::rotary_kernel<{cxx(dtype)}, {BLOCK}>"


def ci_names() -> tuple[str, ...]:
    return tuple(name(t) for t in FLOAT_DTYPES)


def rotary_(kernels: Kernels, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """q: [T, H, hd], k: [T, Hkv, hd] (views into one qkv row are fine: only the head and dim
    strides must be dense); positions: [T] int64; cos, sin: [P, hd] float32 tables."""
    check_tensor(q, "q", FLOAT_DTYPES, 3, aligned=False)
    check_tensor(k, "k", (q.dtype,), 3, aligned=False)
    t, h, hd = q.shape
    require(k.shape[0] == t and k.shape[2] == hd, f"k {tuple(k.shape)} does not match q {tuple(q.shape)}")
    require(q.stride(1) == hd and k.stride(1) == hd, "q and k heads must be dense ([..., H, hd] rows)")
    require(hd % 2 == 0, f"head_dim {hd} must be even")
    check_tensor(positions, "positions", (torch.int64,), 1, aligned=False)
    require(positions.shape == (t,), f"positions {tuple(positions.shape)} must be [{t}]")
    for table, label in ((cos, "cos"), (sin, "sin")):
        check_tensor(table, label, (torch.float32,), 2, aligned=False)
        require(table.is_contiguous() and table.shape[1] == hd, f"{label} must be a contiguous [P, {hd}] table")
    kernels.get(SOURCE, name(q.dtype))((t,), BLOCK, [
        ptr(q), ptr(k), ptr(positions), ptr(cos), ptr(sin), i32(h), i32(k.shape[1]), i32(hd),
        i64(q.stride(0)), i64(k.stride(0))])
