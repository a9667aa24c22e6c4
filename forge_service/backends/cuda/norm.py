"""Typed wrappers for native/norm.cu: RMSNorm and fused residual-add + RMSNorm."""
from __future__ import annotations

import torch

from forge_service.backends.cuda.launch import FLOAT_DTYPES, Kernels, check_tensor, cxx, f32, i32, i64, ptr, require

SOURCE = "norm.cu"
BLOCK = 256


def rms_norm_name(x_dtype: torch.dtype, dtype: torch.dtype) -> str:
    return f"forge::rms_norm_kernel<{cxx(x_dtype)}, {cxx(dtype)}, {BLOCK}>"


def add_rms_norm_name(residual_dtype: torch.dtype, dtype: torch.dtype) -> str:
    return f"forge::add_rms_norm_kernel<{cxx(residual_dtype)}, {cxx(dtype)}, {BLOCK}>"


def ci_names() -> tuple[str, ...]:
    """Instantiations the CI compile check builds: every pairing the model uses."""
    pairs = [(torch.float32, t) for t in FLOAT_DTYPES] + [(t, t) for t in FLOAT_DTYPES[1:]]
    return tuple(f(a, b) for a, b in pairs for f in (rms_norm_name, add_rms_norm_name))


def rms_norm(kernels: Kernels, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, D] (any float dtype), weight: [D] -> [T, D] in weight's dtype."""
    check_tensor(x, "x", FLOAT_DTYPES, 2)
    check_tensor(weight, "weight", FLOAT_DTYPES, 1)
    t, d = x.shape
    require(weight.shape == (d,) and d % 8 == 0, f"weight {tuple(weight.shape)} must be [{d}], {d} % 8 == 0")
    out = torch.empty(t, d, dtype=weight.dtype, device=x.device)
    kernel = kernels.get(SOURCE, rms_norm_name(x.dtype, weight.dtype))
    kernel((t,), BLOCK, [ptr(out), ptr(x), ptr(weight), i32(d), i64(x.stride(0)), i64(out.stride(0)), f32(eps)])
    return out


def add_rms_norm(kernels: Kernels, residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> torch.Tensor:
    """residual += delta in place (residual: [T, D] contiguous, any float dtype; delta: [T, D]
    in weight's dtype); returns rms_norm(residual): [T, D] in weight's dtype."""
    check_tensor(residual, "residual", FLOAT_DTYPES, 2)
    check_tensor(delta, "delta", (weight.dtype,), 2)
    check_tensor(weight, "weight", FLOAT_DTYPES, 1)
    t, d = residual.shape
    require(residual.is_contiguous(), "residual must be contiguous")
    require(delta.shape == (t, d), f"delta {tuple(delta.shape)} must match residual {(t, d)}")
    require(weight.shape == (d,) and d % 8 == 0, f"weight {tuple(weight.shape)} must be [{d}], {d} % 8 == 0")
    out = torch.empty(t, d, dtype=weight.dtype, device=residual.device)
    kernel = kernels.get(SOURCE, add_rms_norm_name(residual.dtype, weight.dtype))
    kernel((t,), BLOCK, [ptr(out), ptr(residual), ptr(delta), ptr(weight), i32(d), i64(delta.stride(0)),
                         i64(out.stride(0)), f32(eps)])
    return out
