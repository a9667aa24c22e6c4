"""Linear layers: a dense weight, plus whatever other form of it the backend's kernels read.

On the CPU that is the checkpoint's own 4-bit or 8-bit codes, or an int8 copy of the lm_head
(backends/cpu_linear.py), and where the native kernels take every batch size the dense weight is
not kept at all; the CUDA backend's GEMMs read the dense weight alone.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from forge_service.backends.base import Backend, QuantCodes


class Linear:
    """y = x @ W.T on `backend`. `codes` is the checkpoint's 4-bit or 8-bit form of W where it has one;
    `int8_rows` allows an int8 copy of a dense W (the lm_head, whose leading logits the model
    recomputes in fp32). The backend decides what it keeps of either."""

    def __init__(self, backend: Backend, weight: torch.Tensor, codes: QuantCodes | None = None,
                 int8_rows: bool = False, dense: Callable[[], torch.Tensor] | None = None) -> None:
        """`weight` may be a meta tensor (its shape and dtype) when `codes` are given: `dense` then
        decodes it, called only if the backend's kernels cannot serve the codes alone."""
        self.backend = backend
        self.packed: Any = backend.pack_linear(weight, codes, int8_rows)  # None: the dense weight alone
        needed = backend.needs_dense(self.packed)
        if needed and weight.is_meta:
            if dense is None:
                raise ValueError(f"a weight {tuple(weight.shape)} was given without its values and without `dense`")
            weight = dense()
        # [N, K] in the compute dtype, or None where the backend never reads it (no second copy)
        self.weight = weight if needed else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N]
        return self.backend.linear(x, self.weight, self.packed)

    def widened(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N] fp32, each value as __call__ rounds it
        return self.backend.linear_widened(x, self.weight, self.packed)
