"""The architecture description a checkpoint loader produces and a model consumes."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ArchConfig:
    """Shape and numerics of a Llama-family decoder, independent of file format."""

    architecture: str  # registry key, e.g. "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # HF-style rope_scaling dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Qwen2: the q, k and v projections add a bias.
    qkv_bias: bool = False
    # Qwen3: each query and key head is RMS-normalised (q_norm / k_norm, [head_dim]) before rotary.
    qk_norm: bool = False
    # SmolLM3: the layers whose attention has no rotary embedding at all (NoPE).
    nope_layers: tuple[int, ...] = ()
    # Phi-3: the checkpoint holds q, k, v as one qkv_proj and gate, up as one gate_up_proj (in the
    # order Forge fuses them anyway).
    fused_projections: bool = False
    # The pooling an embedding model declares ("last", "mean", "cls", ...): a GGUF's
    # {arch}.pooling_type, a sentence-transformers 1_Pooling/config.json. None: none declared.
    pooling: str | None = None


# The architectures Forge serves (the registry's keys), each a Llama decoder plus the ArchConfig
# flags it sets. Mistral is Llama's layer as it stands (its sliding window is a context limit);
# SmolLM3's NoPE layers come from its config (nope_layers).
VARIANTS: dict[str, dict[str, bool]] = {
    "llama": {},
    "mistral": {},
    "qwen2": {"qkv_bias": True},
    "qwen3": {"qk_norm": True},
    "smollm3": {},
    "phi3": {"fused_projections": True},
}


def nope_every(interval: int, num_layers: int) -> tuple[int, ...]:
    """SmolLM3's default NoPE layers: every `interval`-th (the 4th, 8th, ... for 4)."""
    return tuple(i for i in range(num_layers) if (i + 1) % interval == 0)
