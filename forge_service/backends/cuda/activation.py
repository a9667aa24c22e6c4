"""Typed wrapper for native/activation.cu: SiLU-and-multiply over a fused gate/up projection."""
from __future__ import annotations

import torch

from forge_service.backends.cuda.launch import FLOAT_DTYPES, Kernels, check_tensor, cxx, i32, i64, ptr, require

SOURCE = "activation.cu"
BLOCK = 128


def name(dtype: torch.dtype) -> str:
    return f"forge::silu_and_mul_kernel<{cxx(dtype)}, {BLOCK}>"


def ci_names() -> tuple[str, ...]:
    return tuple(name(t) for t in FLOAT_DTYPES)


def silu_and_mul(kernels: Kernels, x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2F] (gate then up) -> silu(gate) * up: [T, F]."""
    check_tensor(x, "x", FLOAT_DTYPES, 2)
    t, two_f = x.shape
    f = two_f // 2
    require(two_f % 16 == 0, f"x's last dimension {two_f} must be 2F with F % 8 == 0")
    out = torch.empty(t, f, dtype=x.dtype, device=x.device)
    kernels.get(SOURCE, name(x.dtype))((t, -(-f // (8 * BLOCK))), BLOCK, [ptr(out), ptr(x), i32(f), i64(x.stride(0))])
    return out
