"""Linear layers over a dense weight and, where the checkpoint stored one, its 4-bit form.

A decode step multiplies a few rows by every weight once, so it is bound by the bytes it reads:
with the checkpoint's own 4-bit codes it reads a quarter of what a bf16 copy costs. Large batches
(prefill chunks) are bound by arithmetic instead and use the dense GEMM.

Small batches run on the CPU backend's native kernels (backends/cpu_kernels.py: int8 activations
times 4-bit or int8 weights, AVX-512 VNNI) where this machine can build and run them, and on
torch's 4-bit and int8 kernels otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from forge_service.backends import cpu_kernels

INT4_GROUP = 32  # inputs per scale and zero
# Up to this many rows the 4-bit kernel beats the bf16 GEMM on CPU (measured on the default
# model's shapes with weights out of cache: 5x at 1 row, 1.3x at 16, 1.1x at 24, slower from 32).
# Decode steps that carry a short prefill chunk stay under it too.
INT4_MAX_ROWS = 24
# Likewise for the per-row int8 kernel (2x at 1 row on the 49k x 576 lm_head, slower from 16).
INT8_MAX_ROWS = 4
# The native kernels against the bf16 GEMM on the default model's shapes: 5x at 1 row on gate_up
# (2x torch's 4-bit kernel), even at 16 to 24 rows, slower from 32; about 4x torch's int8 kernel
# on the lm_head at 1 row.
NATIVE_MAX_ROWS = 24


@dataclass
class Int4Weight:
    """w[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]."""

    codes: torch.Tensor  # [N, K] uint8 in 0..15
    scale: torch.Tensor  # [N, K / 32] float32
    zero: torch.Tensor  # [N, K / 32] float32

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        """Stack along the output dimension (fusing Q/K/V or gate/up)."""
        return Int4Weight(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scale", "zero")))

    def rows(self, index: torch.Tensor) -> Int4Weight:
        return Int4Weight(self.codes[index], self.scale[index], self.zero[index])

    def dequantize(self) -> torch.Tensor:
        n, k = self.codes.shape
        groups = (self.codes.float() - 8).view(n, k // INT4_GROUP, INT4_GROUP)
        return (groups * self.scale[..., None] + self.zero[..., None]).view(n, k)


class Linear:
    """y = x @ W.T. Small batches use the checkpoint's 4-bit codes when it has them, or with
    `int8_rows` an int8 copy of the weight; everything else the dense weight."""

    def __init__(self, weight: torch.Tensor, int4: Int4Weight | None = None, int8_rows: bool = False) -> None:
        self.weight = weight  # [N, K] in the compute dtype
        self.native: cpu_kernels.QuantWeight | None = None  # the native kernels' form
        self.packed: torch.Tensor | None = None  # torch's 4-bit form, without native kernels
        self.scale_zeros: torch.Tensor | None = None
        self.int8: torch.Tensor | None = None  # torch's int8 form, without native kernels
        self.int8_scale: torch.Tensor | None = None
        # Activations go to the native kernels as int8 with a second level in their outlier groups
        # (close to bf16 activations: see cpu_kernels.linear), or as one level for the int8 lm_head:
        # the model recomputes its leading logits in fp32 anyway.
        self.levels = 1 if int8_rows else 2
        if (int4 is not None or int8_rows) and cpu_kernels.supports(weight.shape):
            self.native = (cpu_kernels.pack_q4(int4.codes, int4.scale, int4.zero) if int4 is not None
                           else cpu_kernels.pack_q8(weight))
        elif int4 is not None:
            self.packed, self.scale_zeros = _pack(int4, weight.dtype)
        elif int8_rows:
            self.int8, self.int8_scale = _quantize_rows(weight)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, K] -> [T, N]
        rows = x.shape[0]
        if self.native is not None and rows <= NATIVE_MAX_ROWS:
            return cpu_kernels.linear(x, self.native, self.levels)
        if self.packed is not None and rows <= INT4_MAX_ROWS:
            return torch._weight_int4pack_mm_for_cpu(x.contiguous(), self.packed, INT4_GROUP, self.scale_zeros)
        if self.int8 is not None and rows <= INT8_MAX_ROWS:
            return torch._weight_int8pack_mm(x.contiguous(), self.int8, self.int8_scale)
        return F.linear(x, self.weight)


def int4_supported(weight: torch.Tensor) -> bool:
    """Whether the CPU 4-bit kernel serves this weight: bf16 compute and whole groups."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and k % INT4_GROUP == 0 and n % 16 == 0


def _quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Symmetric int8, one scale per output row: w ~ q * scale.
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [N]
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale.to(weight.dtype)


def _pack(w: Int4Weight, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    packed = torch._convert_weight_to_int4pack_for_cpu(w.codes.to(torch.int32), 1)
    scale_zeros = torch.stack([w.scale, w.zero], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [K/32, N, 2]
    return packed, scale_zeros
