"""Rotary position embeddings (HF "rotate half" layout) with a registry of frequency scalings."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch

from forge_service.errors import InvalidArgument


def _default(inv_freq: torch.Tensor, scaling: dict[str, Any], theta: float) -> torch.Tensor:
    return inv_freq


def _linear(inv_freq: torch.Tensor, scaling: dict[str, Any], theta: float) -> torch.Tensor:
    return inv_freq / float(scaling["factor"])


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any], theta: float) -> torch.Tensor:
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


def _yarn(inv_freq: torch.Tensor, scaling: dict[str, Any], theta: float) -> torch.Tensor:
    # YaRN (Qwen2.5 / Qwen3 long context): frequencies that turn fewer than beta_slow times over the
    # original context are interpolated (divided by `factor`), those that turn more than beta_fast
    # times are kept, and the dimensions between are blended along a linear ramp. The ramp's ends
    # are the dimensions d whose frequency theta^(-2d/dim) turns that many times: d = dim ln(L /
    # (2 pi turns)) / (2 ln theta), rounded outwards unless `truncate` is false.
    factor = float(scaling["factor"])
    context = float(scaling["original_max_position_embeddings"])
    half = inv_freq.numel()
    dim = 2 * half

    def dimension(turns: float) -> float:
        return dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(float(scaling.get("beta_fast") or 32)), dimension(float(scaling.get("beta_slow") or 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(half, dtype=torch.float32) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
    kept = 1 - ramp  # 1: the original frequency, 0: interpolated
    return inv_freq / factor * (1 - kept) + inv_freq * kept


ROPE_SCALINGS: dict[str, Callable[[torch.Tensor, dict[str, Any], float], torch.Tensor]] = {
    "default": _default,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}


def _kind(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                        freq_factors: torch.Tensor | None = None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = _kind(scaling)
    if kind not in ROPE_SCALINGS:
        raise InvalidArgument(f"unsupported rope scaling {kind!r}; supported: {sorted(ROPE_SCALINGS)}")
    inv_freq = ROPE_SCALINGS[kind](inv_freq, scaling or {}, theta)
    if freq_factors is not None:  # llama.cpp stores llama3 scaling as per-frequency divisors
        inv_freq = inv_freq / freq_factors.float()
    return inv_freq


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: YaRN's 0.1 ln(factor) + 1 (or its mscale ratio, or
    the checkpoint's own attention_factor), 1 otherwise."""
    if _kind(scaling) != "yarn":
        return 1.0
    assert scaling is not None
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(weight: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * weight * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


class RotaryEmbedding:
    """Precomputed fp32 cos/sin tables [P, hd] indexed by absolute position; a backend's
    rotary_tables picks a step's rows of them."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None, freq_factors: torch.Tensor | None = None) -> None:
        inv_freq = inverse_frequencies(head_dim, theta, scaling, freq_factors)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, hd]
        scale = attention_factor(scaling)
        self.cos, self.sin = emb.cos() * scale, emb.sin() * scale
