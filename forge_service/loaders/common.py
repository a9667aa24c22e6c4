"""What every loader returns, and the checks that make a checkpoint safe to hand to a model."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from forge_service.backends.base import Int4Weight, Int8Weight
from forge_service.errors import ModelLoadError
from forge_service.layers.rotary import ROPE_SCALINGS
from forge_service.models.arch import ArchConfig

log = logging.getLogger(__name__)

# llama.cpp's per-dimension rope divisors (llama3 rope scaling), kept float32 and 1-D.
ROPE_FREQ_FACTORS = "model.rope_freq_factors"


@dataclass
class Checkpoint:
    """A loaded checkpoint: Hugging Face Llama names and shapes, one dtype, contiguous.

    `lm_head.weight` is absent when `arch.tie_word_embeddings`; `model.rope_freq_factors`
    is present only when a GGUF carries llama.cpp's `rope_freqs.weight`."""

    path: str
    format: str  # "gguf" | "safetensors"
    arch: ArchConfig
    weights: dict[str, torch.Tensor]
    # The 4-bit codes of weights the file stored in a 4-bit encoding (GGUF Q4_0/Q4_1/Q4_K), kept
    # beside their dequantised copies when the compute dtype is bfloat16.
    int4: dict[str, Int4Weight] = field(default_factory=dict)
    # Likewise the int8 codes of weights stored at 5 to 8 bits (Q8_0 exactly; Q6_K, Q5_K re-quantised).
    int8: dict[str, Int8Weight] = field(default_factory=dict)
    # Weights loaded with their codes but not yet decoded (load_checkpoint's `lazy_coded`): in
    # `weights` a meta tensor (shape and dtype only), here the function that decodes it, for a
    # backend whose kernels cannot serve the codes alone.
    decoders: dict[str, Callable[[], torch.Tensor]] = field(default_factory=dict)


def expected_shapes(arch: ArchConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a Llama of this shape needs, HF name -> HF shape (out_features, in_features), with
    the biases and head norms its variant adds."""
    d, f, v = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, d)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (q, d),
            p + "self_attn.k_proj.weight": (kv, d),
            p + "self_attn.v_proj.weight": (kv, d),
            p + "self_attn.o_proj.weight": (d, q),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        }
        if arch.fused_projections:
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                del shapes[p + name + ".weight"]
            shapes |= {p + "self_attn.qkv_proj.weight": (q + 2 * kv, d), p + "mlp.gate_up_proj.weight": (2 * f, d)}
        if arch.qkv_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
        if arch.qk_norm:
            shapes |= {p + "self_attn.q_norm.weight": (arch.head_dim,), p + "self_attn.k_norm.weight": (arch.head_dim,)}
    return shapes


def rope_context(max_positions: int, scaling: dict[str, Any] | None) -> tuple[int, dict[str, Any] | None]:
    """(the context, the scaling) of a model's rope scaling: YaRN opens its factor times its original
    context (Qwen2.5's 128k from 32k; the original defaults to max_position_embeddings, as
    transformers takes it), the others max_position_embeddings."""
    if not scaling or scaling.get("rope_type") != "yarn" or not isinstance(max_positions, int):
        return max_positions, scaling  # (a bad max_positions is check_arch's to name)
    scaling = {**scaling, "original_max_position_embeddings": scaling.get("original_max_position_embeddings")
               or max_positions}
    return max(max_positions, int(scaling["original_max_position_embeddings"] * float(scaling["factor"]))), scaling


def windowed_context(path: str, length: Any, window: int | None) -> Any:
    """The context `length`, capped at a sliding attention window where the model uses one
    (Mistral 7B v0.1's 4,096, Qwen2's with use_sliding_window, Phi-3 mini's 2,047): within the
    window every token sees its whole context, so the model is served exactly, on no more context
    than its window. (A bad `length` is check_arch's to name.)"""
    if window is None or not isinstance(length, int) or window >= length:
        return length
    log.warning("%s: a sliding attention window of %d tokens; the context is capped there (of %d)",
                path, window, length)
    return window


def check_arch(path: str, arch: ArchConfig) -> ArchConfig:
    """Raise unless the sizes are positive integers and the heads group evenly (GQA)."""
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
        value = getattr(arch, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(path, f"{name} must be a positive integer, not {value!r}")
    for name in ("rms_norm_eps", "rope_theta"):
        value = getattr(arch, name)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ModelLoadError(path, f"{name} must be a positive number, not {value!r}")
    if arch.num_heads % arch.num_kv_heads:
        raise ModelLoadError(path, f"{arch.num_heads} heads do not group evenly over {arch.num_kv_heads} KV heads")
    kind = (arch.rope_scaling or {}).get("rope_type") or "default"
    if kind not in ROPE_SCALINGS:  # e.g. Phi-3.5's longrope
        supported = ", ".join(sorted(ROPE_SCALINGS))
        raise ModelLoadError(path, f"rope scaling {kind!r} is not supported; supported: {supported}")
    return arch


def check_tensors(
    path: str, arch: ArchConfig, found: dict[str, tuple[int, ...]], display: Callable[[str], str] = str
) -> None:
    """Raise unless `found` (HF name -> shape, from a file header) is exactly what `arch` needs.

    An unknown tensor is an error too: a Llama model would silently drop it (a bias, say)."""
    expected = expected_shapes(arch)
    missing = sorted(set(expected) - set(found), key=_layer_order)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(path, f"missing tensor {display(missing[0])}{more}")
    unknown = sorted(set(found) - set(expected) - {ROPE_FREQ_FACTORS, "lm_head.weight"})
    if unknown:
        raise ModelLoadError(path, f"unexpected tensor {unknown[0]}: not part of a {arch.architecture} model")
    for name, want in expected.items():
        if tuple(found[name]) != want:
            raise ModelLoadError(path, f"tensor {display(name)} has shape {tuple(found[name])}, expected {want}")


def _layer_order(name: str) -> tuple[int, str]:
    parts = name.split(".")
    return (int(parts[2]) if len(parts) > 2 and parts[2].isdigit() else -1, name)
