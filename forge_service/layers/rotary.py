"""Rotary position embeddings (HF "rotate half" layout) with a registry of frequency scalings."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from forge_service.errors import InvalidArgument


def _default(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    return inv_freq


def _linear(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    return inv_freq / float(scaling["factor"])


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between is blended.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


ROPE_SCALINGS: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
}


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                        freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind not in ROPE_SCALINGS:
        raise InvalidArgument(f"unsupported rope scaling {kind!r}; supported: {sorted(ROPE_SCALINGS)}")
    inv_freq = ROPE_SCALINGS[kind](inv_freq, scaling or {})
    if freq_factors is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq


class RotaryEmbedding:
    """Precomputed fp32 cos/sin tables [P, hd] indexed by absolute position; a backend's
    rotary_tables picks a step's rows of them."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None, freq_factors: torch.Tensor | None = None) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling, freq_factors)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, hd]
        self.cos, self.sin = emb.cos(), emb.sin()
