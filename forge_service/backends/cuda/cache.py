"""Typed wrapper for native/cache.cu: writing K/V into the paged cache by slot mapping."""
from __future__ import annotations

import torch

from forge_service.backends.cuda.launch import (FLOAT_DTYPES, Kernels, check_caches, check_tensor, cxx, i32, i64, ptr,
                                                require)

SOURCE = "cache.cu"
BLOCK = 128


def name(dtype: torch.dtype) -> str:
    return f"forge::write_kv_kernel<{cxx(dtype)}, {BLOCK}>"


def ci_names() -> tuple[str, ...]:
    return tuple(name(t) for t in FLOAT_DTYPES)


def write_kv(kernels: Kernels, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """caches: [S, Hkv, hd] contiguous; k, v: [T, Hkv, hd] (dense heads; any token stride);
    slot_mapping: [T] int64, negative entries skipped."""
    check_caches(k_cache, v_cache, k_cache.dtype)
    require(k_cache.dtype in FLOAT_DTYPES, f"no cache kernel for {k_cache.dtype}")
    for x, label in ((k, "k"), (v, "v")):
        check_tensor(x, label, (k_cache.dtype,), 3)
        require(x.shape[1:] == k_cache.shape[1:] and x.stride(1) == x.shape[2],
                f"{label} {tuple(x.shape)} must be [T, {k_cache.shape[1]}, {k_cache.shape[2]}] with dense heads")
    check_tensor(slot_mapping, "slot_mapping", (torch.int64,), 1, aligned=False)
    t = k.shape[0]
    require(v.shape[0] == t and slot_mapping.shape == (t,), "k, v and slot_mapping must have one row per token")
    row = k_cache.shape[1] * k_cache.shape[2]
    kernels.get(SOURCE, name(k.dtype))((t,), BLOCK, [
        ptr(k_cache), ptr(v_cache), ptr(k), ptr(v), ptr(slot_mapping), i32(row), i64(k.stride(0)), i64(v.stride(0))])
