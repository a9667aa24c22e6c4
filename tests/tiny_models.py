"""Tiny random-weight Llama checkpoints for tests: SafeTensors directories and GGUF files.

The vocabulary is byte-level BPE with no merges (256 byte tokens + specials), so any text
tokenizes, and `tiny_tokenizer_json()` gives a matching tokenizer.json."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Mapping

import gguf
import numpy as np
import torch
from safetensors.torch import save_file

from forge_service.models.arch import ArchConfig

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
TINY_VOCAB_SIZE = 320
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def tiny_arch(**overrides: Any) -> ArchConfig:
    """A 2-layer GQA Llama (hidden 64, 4 heads of 16, 2 KV heads); head_dim follows hidden/heads."""
    fields: dict[str, Any] = dict(
        architecture="llama", vocab_size=TINY_VOCAB_SIZE, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=4, num_kv_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=False, rope_scaling=None,
        bos_token_id=1, eos_token_ids=(2,),
    )
    fields |= overrides
    fields.setdefault("head_dim", fields["hidden_size"] // fields["num_heads"])
    return ArchConfig(**fields)


def random_weights(arch: ArchConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """HF-named float32 weights: N(0, 0.02) matrices, norms near 1 (not exactly, so norm bugs show),
    biases N(0, 0.1)."""
    from forge_service.loaders.common import expected_shapes

    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(arch).items():
        w = torch.randn(shape, generator=g)
        weights[name] = 0.1 * w if name.endswith(".bias") else 1.0 + 0.1 * w if len(shape) == 1 else 0.02 * w
    return weights


# ---- vocabulary -------------------------------------------------------------------------------

# The tiny models' sizes for the GPU tests: head_dim 64, which the CUDA decode kernel takes (the
# default tiny head_dim, 16, it does not).
GPU_SIZES: dict[str, Any] = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)


def unigram_weights(arch: ArchConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random weights with every token embedded alike: every position's hidden state, and so its
    next-token distribution, is the same whatever the context (a unigram model)."""
    w = random_weights(arch, seed)
    embed = w["model.embed_tokens.weight"]
    w["model.embed_tokens.weight"] = embed[:1].expand_as(embed).clone()
    return w


def byte_level_chars() -> list[str]:
    """GPT-2's byte -> printable character table, indexed by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def tiny_vocab(vocab_size: int = TINY_VOCAB_SIZE) -> list[str]:
    """Specials, the 256 byte tokens, then reserved specials up to `vocab_size`."""
    tokens = SPECIAL_TOKENS + byte_level_chars()
    assert vocab_size >= len(tokens), f"vocab_size must be >= {len(tokens)}"
    return tokens + [f"<|reserved_{i}|>" for i in range(vocab_size - len(tokens))]


def tiny_tokenizer_json(vocab_size: int = TINY_VOCAB_SIZE) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = tiny_vocab(vocab_size)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(vocab)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True) for t in vocab if t.startswith("<|")])
    return tok.to_str()


# ---- SafeTensors directories ---------------------------------------------------------------

# Hugging Face's name for each architecture Forge serves (ArchConfig.architecture).
HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "phi3": "Phi3ForCausalLM"}


def variant_arch(architecture: str, **overrides: Any) -> ArchConfig:
    """tiny_arch for one of Forge's architectures, with the flags its loaders set (SmolLM3: its
    last layer without rotary, unless `nope_layers` says otherwise)."""
    from forge_service.models.arch import VARIANTS

    if architecture == "smollm3":
        overrides.setdefault("nope_layers", (overrides.get("num_layers", 2) - 1,))
    return tiny_arch(architecture=architecture, **VARIANTS[architecture], **overrides)


def hf_config(arch: ArchConfig, **overrides: Any) -> dict[str, Any]:
    config = {
        "architectures": [HF_ARCHITECTURES[arch.architecture]], "model_type": arch.architecture, "hidden_act": "silu",
        "vocab_size": arch.vocab_size, "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size, "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads, "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim, "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling, "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings, "bos_token_id": arch.bos_token_id,
        "eos_token_id": arch.eos_token_ids[0] if arch.eos_token_ids else None,
        "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
    }
    if arch.architecture == "smollm3":
        config["no_rope_layers"] = [0 if i in arch.nope_layers else 1 for i in range(arch.num_layers)]
    if arch.architecture in ("smollm3", "phi3"):
        config["pad_token_id"] = None  # their defaults (128004, 32000) are outside a tiny vocabulary
    return config | overrides


def write_safetensors_dir(
    dir: str | os.PathLike[str], arch: ArchConfig, weights: Mapping[str, torch.Tensor],
    tokenizer_json: str | None = None, chat_template: str | None = None,
    eos_token_id: int | list[int] | None = ..., shards: int = 1, dtype: torch.dtype = torch.float32,
    config_overrides: Mapping[str, Any] | None = None, generation: Mapping[str, Any] | None = None,
) -> Path:
    """A Hugging Face Llama directory. `eos_token_id` goes to generation_config.json
    (default: all of arch.eos_token_ids; None leaves it out), and `generation`'s entries (e.g. a
    sampling temperature); `shards` > 1 writes an index."""
    root = Path(dir)
    root.mkdir(parents=True, exist_ok=True)
    _write_json(root / "config.json", hf_config(arch, **(config_overrides or {})))
    generation_config: dict[str, Any] = {"bos_token_id": arch.bos_token_id}
    if eos_token_id is ...:
        eos_token_id = list(arch.eos_token_ids)
    if eos_token_id is not None:
        generation_config["eos_token_id"] = eos_token_id
    _write_json(root / "generation_config.json", {**generation_config, **(generation or {})})
    vocab = tiny_vocab(max(arch.vocab_size, len(SPECIAL_TOKENS) + 256))
    tokenizer_config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                        "bos_token": vocab[arch.bos_token_id or 0],
                                        "eos_token": vocab[arch.eos_token_ids[0] if arch.eos_token_ids else 0]}
    if chat_template is not None:
        tokenizer_config["chat_template"] = chat_template
    _write_json(root / "tokenizer_config.json", tokenizer_config)
    if tokenizer_json is not None:
        (root / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    tensors = {n: w.to(dtype).contiguous() for n, w in weights.items()
               if not (arch.tie_word_embeddings and n == "lm_head.weight")}
    _write_shards(root, tensors, shards)
    return root


def _write_shards(root: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    if shards == 1:
        save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for k in range(shards):
        file = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[k::shards]}
        save_file(part, str(root / file), metadata={"format": "pt"})
        weight_map |= {n: file for n in part}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(root / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")


# ---- GGUF files ----------------------------------------------------------------------------

def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's Q/K row permutation (HF rotate-half order -> llama.cpp pair order)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_name(hf_name: str) -> str:
    from forge_service.loaders.gguf import gguf_name

    return gguf_name(hf_name)


def write_gguf(
    path: str | os.PathLike[str], arch: ArchConfig, weights: Mapping[str, torch.Tensor],
    qtype: str = "F32", vocab: list[str] | None = None, chat_template: str | None = None,
    tensor_qtypes: Mapping[str, str] | None = None, architecture: str | None = None,
    uint32_keys: Mapping[str, int] | None = None, float32_keys: Mapping[str, float] | None = None,
) -> Path:
    """A llama.cpp-style GGUF: Q/K rows permuted (Llama, SmolLM3; Qwen's are stored as they are), 1-D
    tensors F32, matrices in `qtype` (per-HF-name overrides in `tensor_qtypes`). A llama3
    `arch.rope_scaling` becomes a `rope_freqs.weight` tensor, as convert_hf_to_gguf writes it.
    `architecture` is general.architecture (arch.architecture unless given); `uint32_keys`: more
    metadata (e.g. {"qwen3.pooling_type": 3}), and `float32_keys` (e.g. {"general.sampling.temp": 0.6})."""
    architecture = architecture or arch.architecture
    w = gguf.GGUFWriter(str(path), architecture)
    permute = architecture in ("llama", "smollm3")  # convert_hf_to_gguf's LlamaModel and its SmolLM3Model
    _write_arch_metadata(w, arch)
    for key, value in (uint32_keys or {}).items():
        w.add_uint32(key, value)
    for key, value in (float32_keys or {}).items():
        w.add_float32(key, value)
    _write_vocab(w, arch, vocab or tiny_vocab(arch.vocab_size), chat_template)
    tensors = dict(weights)
    if arch.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    if arch.rope_scaling and arch.rope_scaling.get("rope_type") == "llama3":
        tensors.setdefault("model.rope_freq_factors", llama3_rope_factors(arch))
    for name, tensor in tensors.items():
        data = tensor.float().numpy()
        if permute and name.endswith("q_proj.weight"):
            data = permute_qk(data, arch.num_heads)
        elif permute and name.endswith("k_proj.weight"):
            data = permute_qk(data, arch.num_kv_heads)
        kind = "F32" if data.ndim == 1 else (tensor_qtypes or {}).get(name, qtype)
        _add_tensor(w, gguf_tensor_name(name), np.ascontiguousarray(data), kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _write_arch_metadata(w: gguf.GGUFWriter, arch: ArchConfig) -> None:
    w.add_block_count(arch.num_layers)
    w.add_context_length(arch.max_position_embeddings)
    w.add_embedding_length(arch.hidden_size)
    w.add_feed_forward_length(arch.intermediate_size)
    w.add_head_count(arch.num_heads)
    w.add_head_count_kv(arch.num_kv_heads)
    w.add_rope_freq_base(arch.rope_theta)
    w.add_layer_norm_rms_eps(arch.rms_norm_eps)
    w.add_rope_dimension_count(arch.head_dim)
    w.add_vocab_size(arch.vocab_size)
    if arch.head_dim != arch.hidden_size // arch.num_heads:
        w.add_key_length(arch.head_dim)
        w.add_value_length(arch.head_dim)
    scaling = arch.rope_scaling or {}
    if scaling.get("rope_type") in ("linear", "yarn"):
        w.add_rope_scaling_type(gguf.RopeScalingType(scaling["rope_type"]))
        w.add_rope_scaling_factor(scaling["factor"])
        if "original_max_position_embeddings" in scaling:
            w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])


def _write_vocab(w: gguf.GGUFWriter, arch: ArchConfig, vocab: list[str], chat_template: str | None) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_token_list(vocab)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL for t in vocab])
    w.add_token_merges([])
    if arch.bos_token_id is not None:
        w.add_bos_token_id(arch.bos_token_id)
    if arch.eos_token_ids:
        w.add_eos_token_id(arch.eos_token_ids[0])
    if chat_template is not None:
        w.add_chat_template(chat_template)


def _add_tensor(w: gguf.GGUFWriter, name: str, data: np.ndarray, kind: str) -> None:
    qtype = gguf.GGMLQuantizationType[kind]
    if qtype == gguf.GGMLQuantizationType.F32:
        w.add_tensor(name, data)
    elif qtype == gguf.GGMLQuantizationType.F16:
        w.add_tensor(name, data.astype(np.float16))
    else:
        encode = KQUANT_ENCODERS.get(kind, lambda x: gguf.quants.quantize(x, qtype))
        w.add_tensor(name, encode(data), raw_dtype=qtype)


def llama3_rope_factors(arch: ArchConfig) -> torch.Tensor:
    """convert_hf_to_gguf's rope_freqs for llama3 rope scaling: [head_dim / 2] divisors of inv_freq."""
    s = arch.rope_scaling or {}
    factor, low, high = s.get("factor", 8.0), s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_ctx = s.get("original_max_position_embeddings", 8192)
    out = []
    for i in range(0, arch.head_dim, 2):
        wavelen = 2 * math.pi * arch.rope_theta ** (i / arch.head_dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


# ---- K-quant encoders ------------------------------------------------------------------------
# gguf's Python package only decodes K-quants; these simple (not error-optimal) encoders follow
# ggml-common.h's block layouts so tests can check the decoding path end to end.

def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe(x: np.ndarray) -> np.ndarray:
    return np.where(x == 0, 1.0, x)


def _affine_superblocks(rows: np.ndarray, nmax: int) -> tuple[np.ndarray, ...]:
    """Q4_K/Q5_K: 8 sub-blocks of 32, each x ~= d*sc*q - dmin*m with 6-bit sc, m."""
    sub = rows.reshape(-1, 8, 32).astype(np.float32)
    lo, hi = np.minimum(sub.min(-1), 0), sub.max(-1)
    scale, mins = (hi - lo) / nmax, -lo  # [n, 8]
    d, dmin = _f16(scale.max(-1) / 63), _f16(mins.max(-1) / 63)  # [n]
    sc = np.clip(np.round(scale / _safe(d.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    m = np.clip(np.round(mins / _safe(dmin.astype(np.float32))[:, None]), 0, 63).astype(np.uint8)
    step, offset = d.astype(np.float32)[:, None] * sc, dmin.astype(np.float32)[:, None] * m
    q = np.clip(np.round((sub + offset[..., None]) / _safe(step)[..., None]), 0, nmax).astype(np.uint8)
    packed = np.concatenate([(sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
                             (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)], axis=1)
    return d, dmin, packed, q.reshape(-1, 256)


def _nibbles(q: np.ndarray) -> np.ndarray:
    # byte 32c + l holds elements 64c + l (low nibble) and 64c + 32 + l (high nibble)
    q = q.reshape(-1, 4, 2, 32) & 0xF
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def encode_q4_k(rows: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _affine_superblocks(rows, 15)
    head = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales]
    blocks = np.concatenate([*head, _nibbles(q)], 1)
    return blocks.reshape(*rows.shape[:-1], -1)


def encode_q5_k(rows: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _affine_superblocks(rows, 31)
    high = ((q.reshape(-1, 8, 32) >> 4) & 1) << np.arange(8, dtype=np.uint8)[None, :, None]  # bit k: sub-block k
    qh = high.sum(1, dtype=np.uint8)
    head = [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), scales]
    blocks = np.concatenate([*head, qh, _nibbles(q)], 1)
    return blocks.reshape(*rows.shape[:-1], -1)


def encode_q6_k(rows: np.ndarray) -> np.ndarray:
    sub = rows.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(sub).max(-1) / 31  # [n, 16]
    d = _f16(scale.max(-1) / 127)
    sc = np.clip(np.round(scale / _safe(d.astype(np.float32))[:, None]), 0, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(sub / _safe(step)[..., None]), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # element 128h + 32k + l
    ql = np.concatenate([(q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                         (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)], axis=2).reshape(-1, 128)
    qh = sum((q[:, :, k] >> 4) << (2 * k) for k in range(4)).astype(np.uint8).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], 1)
    return blocks.reshape(*rows.shape[:-1], -1)


IQ4_NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32)


def encode_iq4_nl(rows: np.ndarray) -> np.ndarray:
    """IQ4_NL blocks of 32 (d fp16, then 16 bytes of 4-bit indices into IQ4_NL_VALUES, element j in
    the low nibble of byte j and j + 16 in its high one), each value the nearest of d x the table."""
    blocks = rows.reshape(-1, 32).astype(np.float32)
    largest = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(-1)]
    d = _f16(largest / IQ4_NL_VALUES[0])
    scaled = blocks / _safe(d.astype(np.float32))[:, None]
    idx = np.abs(scaled[..., None] - IQ4_NL_VALUES).argmin(-1).astype(np.uint8)
    qs = idx[:, :16] | (idx[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), qs], axis=1).reshape(rows.shape[0], -1)


KQUANT_ENCODERS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k, "IQ4_NL": encode_iq4_nl,
}
