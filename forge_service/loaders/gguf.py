"""GGUF checkpoints (llama.cpp's format): metadata -> ArchConfig, tensors -> dequantised HF weights."""
from __future__ import annotations

import functools
from typing import Any, Callable

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from forge_service.backends.base import Int4Weight, Int8Weight
from forge_service.errors import ModelLoadError
from forge_service.loaders.common import ROPE_FREQ_FACTORS, Checkpoint, check_arch, check_tensors, rope_context, \
    windowed_context
from forge_service.loaders.gguf_file import GGUFFile, Tensor, read_gguf
from forge_service.loaders.gguf_int4 import INT4_TYPES, int4_weight
from forge_service.loaders.gguf_int8 import INT8_TYPES, int8_weight
from forge_service.models.arch import VARIANTS, ArchConfig, nope_every

# general.architecture -> model registry key (a Mistral GGUF says "llama").
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "smollm3": "smollm3",
                           "phi3": "phi3"}
# Whose Q/K rows convert_hf_to_gguf permuted: llama.cpp's Llama rotates adjacent pairs. Qwen's
# rotary (llama.cpp's NEOX) rotates halves as Hugging Face does, so its rows are stored as they are.
PERMUTED_QK = {"llama", "smollm3"}

# llama.cpp tensor names -> Hugging Face names. Per-layer names are under blk.{i}.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "rope_freqs.weight": ROPE_FREQ_FACTORS,
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",  # Qwen2
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}

# llama.cpp's pooling types (`{arch}.pooling_type`) -> ArchConfig.pooling; 0 is none declared.
_POOLING = {0: None, 1: "mean", 2: "cls", 3: "last", 4: "rank"}

# A fused-projection model's (Phi-3's) layer names, where they differ: its ffn_up holds gate and up.
_FUSED_LAYER_NAMES = {
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_up.weight": "mlp.gate_up_proj.weight",
}

# GGUF `{arch}.rope.scaling.*` keys -> HF rope_scaling keys.
_ROPE_SCALING_KEYS = {
    "factor": "factor",
    "original_context_length": "original_max_position_embeddings",
    "attn_factor": "attention_factor",
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
}


def _float_copy(t: Tensor) -> torch.Tensor:
    return torch.from_numpy(np.array(t.data))  # F32/F16: the reader already typed and shaped it


def _bf16(t: Tensor) -> torch.Tensor:
    # The reader hands BF16 over as raw bytes [rows, 2 * cols]; numpy has no bfloat16.
    return torch.from_numpy(np.array(t.data).view(np.int16)).view(torch.bfloat16)


def _dequantize(t: Tensor) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type))


# Tensor encodings we decode, each to a float tensor in HF shape.
DECODERS: dict[QType, Callable[[Tensor], torch.Tensor]] = {
    QType.F32: _float_copy,
    QType.F16: _float_copy,
    QType.BF16: _bf16,
    **{q: _dequantize for q in (QType.Q8_0, QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q5_K, QType.Q6_K, QType.Q5_0,
                                QType.Q5_1, QType.Q3_K, QType.Q2_K, QType.IQ4_NL, QType.IQ4_XS)},
}


def load_gguf(path: str, dtype: torch.dtype, lazy_coded: bool = False) -> Checkpoint:
    """With `lazy_coded`, the projections that also get 4- or 8-bit codes are not decoded (see
    Checkpoint.decoders): half of loading the default model, and its largest transient memory."""
    reader = read_gguf(path)
    arch = check_arch(path, arch_from_gguf(path, reader))
    tensors = {hf_name(path, t.name, arch.fused_projections): t for t in reader.tensors}
    check_tensors(path, arch, {n: tuple(reversed(t.shape.tolist())) for n, t in tensors.items()},
                  display=lambda n: f"{gguf_name(n)} ({n})")
    _check_types(path, tensors.values())
    _check_rope_freqs(path, arch, tensors)
    projections = {name: t for name, t in tensors.items() if dtype == torch.bfloat16 and name.endswith("proj.weight")}
    int4 = {name: _codes(int4_weight, t, name, arch) for name, t in projections.items() if t.tensor_type in INT4_TYPES}
    int8 = {name: _codes(int8_weight, t, name, arch) for name, t in projections.items() if t.tensor_type in INT8_TYPES}
    decoders = {name: functools.partial(_decode, tensors[name], name, arch, dtype)
                for name in (int4.keys() | int8.keys() if lazy_coded else ())}
    weights = {name: torch.empty(tuple(reversed(t.shape.tolist())), dtype=dtype, device="meta") if name in decoders
               else _decode(t, name, arch, dtype) for name, t in tensors.items()}
    if arch.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    return Checkpoint(path=path, format="gguf", arch=arch, weights=weights, int4=int4, int8=int8, decoders=decoders)


def arch_from_gguf(path: str, reader: GGUFFile) -> ArchConfig:
    """The ArchConfig described by a GGUF's `general.architecture` and `{arch}.*` metadata."""
    meta = Metadata(path, reader)
    name = meta.get("general.architecture")
    if name not in SUPPORTED_ARCHITECTURES:
        supported = sorted(SUPPORTED_ARCHITECTURES)
        raise ModelLoadError(path, f"unsupported architecture {name!r} (supported: {supported})")
    a = name
    hidden, heads = meta.get(f"{a}.embedding_length"), meta.get(f"{a}.attention.head_count")
    if not all(isinstance(v, int) and v > 0 for v in (hidden, heads)):
        raise ModelLoadError(path, f"embedding_length {hidden!r} and head_count {heads!r} must be positive integers")
    head_dim = meta.get(f"{a}.attention.key_length", hidden // heads)
    context, rope_scaling = rope_context(meta.get(f"{a}.context_length"), _rope_scaling(meta, a))
    window = meta.get(f"{a}.attention.sliding_window", None)
    context = windowed_context(path, context, window if isinstance(window, int) and window > 0 else None)
    if meta.get(f"{a}.rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(path, "partial rotary embeddings (rope.dimension_count != head_dim) are not supported")
    return ArchConfig(
        architecture=SUPPORTED_ARCHITECTURES[name],
        vocab_size=meta.get(f"{a}.vocab_size", None) or _vocab_length(path, reader),
        hidden_size=hidden,
        intermediate_size=meta.get(f"{a}.feed_forward_length"),
        num_layers=meta.get(f"{a}.block_count"),
        num_heads=heads,
        num_kv_heads=meta.get(f"{a}.attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=meta.get(f"{a}.attention.layer_norm_rms_epsilon"),
        rope_theta=meta.get(f"{a}.rope.freq_base", 10000.0),
        max_position_embeddings=context,
        tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
        rope_scaling=rope_scaling,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=_eos_ids(meta),
        pooling=_POOLING.get(meta.get(f"{a}.pooling_type", 0), "unknown"),
        # llama.cpp's SmolLM3: every 4th layer without rotary (not in the file's metadata)
        nope_layers=nope_every(4, meta.get(f"{a}.block_count")) if name == "smollm3" else (),
        **VARIANTS[SUPPORTED_ARCHITECTURES[name]],
    )


class Metadata:
    """Typed access to GGUF key/values; a missing required key is a ModelLoadError."""

    _REQUIRED = object()

    def __init__(self, path: str, reader: GGUFFile) -> None:
        self.path, self.fields = path, reader.fields

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self.fields.get(key)
        if field is None:
            if default is self._REQUIRED:
                raise ModelLoadError(self.path, f"missing metadata key {key}")
            return default
        try:
            value = field.contents()
        except ValueError as e:  # e.g. a string that is not UTF-8
            raise ModelLoadError(self.path, f"bad metadata value for {key}: {e}") from e
        if field.types == [gguf.GGUFValueType.FLOAT32]:
            value = float(str(np.float32(value)))  # 1e-05, not 9.999999747378752e-06
        return value


def _vocab_length(path: str, reader: GGUFFile) -> int:
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelLoadError(path, "no vocab_size: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")
    return len(tokens.value)


def _rope_scaling(meta: Metadata, a: str) -> dict[str, Any] | None:
    kind = meta.get(f"{a}.rope.scaling.type", None)
    if kind is None and meta.get(f"{a}.rope.scale_linear", None) is not None:  # older files
        return {"rope_type": "linear", "factor": meta.get(f"{a}.rope.scale_linear")}
    if kind in (None, "none"):
        return None
    scaling: dict[str, Any] = {"rope_type": kind}
    for key, hf_key in _ROPE_SCALING_KEYS.items():
        value = meta.get(f"{a}.rope.scaling.{key}", None)
        if value is not None:
            scaling[hf_key] = value
    return scaling


def _eos_ids(meta: Metadata) -> tuple[int, ...]:
    # llama.cpp also stops on end-of-turn / end-of-message tokens, as HF generation configs list them.
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = [meta.get(k, None) for k in keys]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def hf_name(path: str, name: str, fused: bool = False) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".", 2)
    layer_names = {**_LAYER_NAMES, **_FUSED_LAYER_NAMES} if fused else _LAYER_NAMES
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    raise ModelLoadError(path, f"unexpected tensor {name}: not part of a model Forge serves")


def gguf_name(hf_name: str) -> str:
    """The llama.cpp name of a Hugging Face Llama weight name."""
    for gname, hname in _GLOBAL_NAMES.items():
        if hname == hf_name:
            return gname
    _, _, layer, rest = hf_name.split(".", 3)
    names = [*_LAYER_NAMES.items(), *_FUSED_LAYER_NAMES.items()]
    return f"blk.{layer}." + next(g for g, h in names if h == rest)


def _check_types(path: str, tensors: Any) -> None:
    for t in tensors:
        if t.tensor_type not in DECODERS:
            supported = ", ".join(q.name for q in DECODERS)
            raise ModelLoadError(path, f"tensor {t.name} has type {t.tensor_type.name}; supported: {supported}")


def _check_rope_freqs(path: str, arch: ArchConfig, tensors: dict[str, Tensor]) -> None:
    t = tensors.get(ROPE_FREQ_FACTORS)
    if t is not None and t.shape.tolist() != [arch.head_dim // 2]:
        raise ModelLoadError(path, f"tensor {t.name} has shape {t.shape.tolist()}, expected [{arch.head_dim // 2}]")


def _decode(t: Tensor, name: str, arch: ArchConfig, dtype: torch.dtype) -> torch.Tensor:
    w = DECODERS[t.tensor_type](t)  # [out, in] or [n]
    if name == ROPE_FREQ_FACTORS:
        return w.float().contiguous()
    if arch.architecture in PERMUTED_QK and name.endswith("q_proj.weight"):
        w = unpermute_qk(w, arch.num_heads)
    elif arch.architecture in PERMUTED_QK and name.endswith("k_proj.weight"):
        w = unpermute_qk(w, arch.num_kv_heads)
    return w.to(dtype).contiguous()


def _codes(read: Callable[[np.ndarray, QType, int, int], Int4Weight | Int8Weight], t: Tensor, name: str,
           arch: ArchConfig) -> Int4Weight | Int8Weight:
    """A projection's quantised codes, read by `read`, in HF row order."""
    rows, cols = reversed(t.shape.tolist())
    w = read(t.data, t.tensor_type, rows, cols)
    if arch.architecture not in PERMUTED_QK:
        return w
    if name.endswith("q_proj.weight"):
        return w.rows(unpermute_qk(torch.arange(rows), arch.num_heads))
    if name.endswith("k_proj.weight"):
        return w.rows(unpermute_qk(torch.arange(rows), arch.num_kv_heads))
    return w


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo convert_hf_to_gguf's Q/K row permutation, which interleaves the two rotary halves
    of each head (HF rotates x[:d/2] with x[d/2:]; llama.cpp rotates adjacent pairs)."""
    # w: [n_head * head_dim, in]; viewed as [n_head, head_dim/2, 2, in] -> [n_head, 2, head_dim/2, in]
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

