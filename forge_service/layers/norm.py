"""RMSNorm with Hugging Face Llama numerics (normalise in fp32, scale in the compute dtype)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, D] (any float dtype), weight: [D] -> [T, D] in weight's dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(weight.dtype)
