"""The CPU backend's linear layers: a checkpoint's quantised weights on the native kernels, else
the dense weight.

Where this machine can build and run the native kernels (cpu_kernels.py: int8 activations times
4-bit or int8 weights, AVX-512 VNNI), every batch size takes them: a decode step reads a quarter
of a bf16 copy's bytes, and large batches (prefill chunks, many decodes) do twice the bf16 GEMM's
arithmetic rate on this machine's shapes (bench/activation_fidelity.py and the kernel tests say
what it costs in fidelity). One path for every M also makes a row's result independent of what
shares its step (see native/cpu/quant_gemm.c). The dense weight is then not kept at all.

Where they cannot run, small batches use torch's 4-bit and int8 kernels and large ones the dense
GEMM.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from forge_service.backends import cpu_kernels
from forge_service.backends.base import INT4_GROUP, Int4Weight, Int8Weight, QuantCodes

# Without the native kernels: up to this many rows torch's 4-bit kernel beats the bf16 GEMM
# (5x at 1 row, 1.3x at 16, 1.1x at 24, slower from 32).
INT4_MAX_ROWS = 24
# Likewise for torch's per-row int8 kernel (2x at 1 row on the 49k x 576 lm_head, slower from 16).
INT8_MAX_ROWS = 4


@dataclass
class CpuWeight:
    """The quantised forms of one weight: the native kernels' where they run here (every batch size),
    else torch's 4-bit or int8 one (small batches)."""

    native: cpu_kernels.QuantWeight | None = None
    # Activations go to the native kernels as int8 with a second level in their outlier groups
    # (close to bf16 activations: see cpu_kernels.linear), or as one level for the int8 lm_head:
    # the model recomputes its leading logits in fp32 anyway.
    levels: int = 2
    int4pack: torch.Tensor | None = None  # torch's 4-bit form
    scale_zeros: torch.Tensor | None = None
    int8: torch.Tensor | None = None  # torch's int8 form
    int8_scale: torch.Tensor | None = None


def pack(weight: torch.Tensor, codes: QuantCodes | None, int8_rows: bool) -> CpuWeight | None:
    """The quantised form of weight [N, K] in bf16: the checkpoint's 4-bit or 8-bit codes where it
    has them, or with `int8_rows` an int8 copy (one activation level); None where the dense GEMM
    serves alone (fp32, the reference, always)."""
    if weight.dtype != torch.bfloat16:
        return None
    native = cpu_kernels.supports(weight.shape)
    if isinstance(codes, Int4Weight) and int4_supported(weight):
        if native:
            return CpuWeight(native=cpu_kernels.pack_q4(codes.codes, codes.scale, codes.zero))
        int4pack, scale_zeros = _pack(codes, weight.dtype)
        return CpuWeight(int4pack=int4pack, scale_zeros=scale_zeros)
    if isinstance(codes, Int8Weight) and native:  # without the native kernels: the dense GEMM
        return CpuWeight(native=cpu_kernels.pack_q8_codes(codes))
    if int8_rows:
        if native:
            return CpuWeight(native=cpu_kernels.pack_q8(weight), levels=1)
        int8, int8_scale = _quantize_rows(weight)
        return CpuWeight(levels=1, int8=int8, int8_scale=int8_scale)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor | None, packed: CpuWeight | None) -> torch.Tensor:
    # x: [T, K] -> [T, N]
    rows = x.shape[0]
    if packed is not None:
        if packed.native is not None:
            return cpu_kernels.linear(x, packed.native, packed.levels)
        if packed.int4pack is not None and rows <= INT4_MAX_ROWS:
            return torch._weight_int4pack_mm_for_cpu(x.contiguous(), packed.int4pack, INT4_GROUP, packed.scale_zeros)
        if packed.int8 is not None and rows <= INT8_MAX_ROWS:
            return torch._weight_int8pack_mm(x.contiguous(), packed.int8, packed.int8_scale)
    return F.linear(x, weight)


def linear_widened(x: torch.Tensor, weight: torch.Tensor | None, packed: CpuWeight | None) -> torch.Tensor:
    # linear(x, ...) as fp32, its values as linear rounds them: the native GEMMs store them so
    # (no bf16 output to widen in a second pass)
    if packed is not None and packed.native is not None and x.dtype == torch.bfloat16:
        return cpu_kernels.linear(x, packed.native, packed.levels, widened=True)
    return linear(x, weight, packed).float()


def needs_dense(packed: CpuWeight | None) -> bool:
    """Whether `linear` may read the dense weight: not once the native kernels take every batch."""
    return packed is None or packed.native is None


def int4_supported(weight: torch.Tensor) -> bool:
    """Whether the CPU 4-bit kernels serve this weight: bf16 compute and whole groups."""
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
