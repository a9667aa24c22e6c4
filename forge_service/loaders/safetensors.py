"""Hugging Face checkpoint directories: config.json (+ generation_config.json) and SafeTensors,
single-file or sharded through model.safetensors.index.json."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from forge_service.errors import ModelLoadError
from forge_service.loaders.common import Checkpoint, check_arch, check_tensors, rope_context, windowed_context
from forge_service.models.arch import VARIANTS, ArchConfig, nope_every

# config.json model_type / architectures entry -> model registry key.
SUPPORTED_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                         "smollm3": "smollm3", "phi3": "phi3"}
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2",
                           "Qwen3ForCausalLM": "qwen3", "SmolLM3ForCausalLM": "smollm3", "Phi3ForCausalLM": "phi3"}
FLOAT_DTYPES = ("F32", "F16", "BF16")
# Buffers older transformers versions saved; they are recomputed, never loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
SINGLE_FILE, INDEX_FILE = "model.safetensors", "model.safetensors.index.json"
# sentence-transformers' pooling modes -> ArchConfig.pooling (others keep their own names)
_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


def load_safetensors(path: str, dtype: torch.dtype) -> Checkpoint:
    root = Path(path)
    config = read_json(root / "config.json", required=True)
    generation = read_json(root / "generation_config.json", required=False)
    config_path = str(root / "config.json")
    arch = check_arch(config_path, arch_from_hf_config(config_path, config, generation, _pooling(root)))
    files = _tensor_files(root)  # name in the files -> file holding it
    names = {name: name for name in files}  # HF causal-LM name -> name in the files
    if "model.embed_tokens.weight" not in files and "embed_tokens.weight" in files:
        # The decoder saved alone, without its head (Qwen3-Embedding's files, whose config still
        # names Qwen3ForCausalLM): its names lack the `model.` prefix, and the head is the embedding.
        names = {f"model.{name}": name for name in files}
        arch = replace(arch, tie_word_embeddings=True)
    handles = {f: _open(f) for f in sorted(set(files.values()))}
    shapes = {hf: _shape(handles[files[name]], files[name], name) for hf, name in names.items()}
    check_tensors(str(root), arch, shapes)
    if arch.tie_word_embeddings:
        names.pop("lm_head.weight", None)
    weights = {hf: _read(handles[files[name]], files[name], name, dtype) for hf, name in names.items()}
    return Checkpoint(path=str(root), format="safetensors", arch=arch, weights=weights)


def arch_from_hf_config(path: str, config: dict[str, Any], generation: dict[str, Any],
                        pooling: str | None = None) -> ArchConfig:
    """The ArchConfig of a Llama, Mistral, Qwen2 or Qwen3 config.json; generation_config.json's
    eos_token_id wins."""
    key = _registry_key(path, config)
    for flag in ("attention_bias", "mlp_bias"):  # Llama's attention_bias includes o_proj's (Qwen2's biases are its own)
        if config.get(flag):
            raise ModelLoadError(path, f"{flag}=true is not supported")
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(path, f"hidden_act {config.get('hidden_act')!r} is not supported (only silu)")
    hidden, heads = _int(path, config, "hidden_size"), _int(path, config, "num_attention_heads")
    rope_theta, rope_scaling = _rope(path, config)
    context, rope_scaling = rope_context(_int(path, config, "max_position_embeddings", 2048), rope_scaling)
    context = windowed_context(path, context, _window(path, config))
    return ArchConfig(
        architecture=key,
        vocab_size=_int(path, config, "vocab_size"),
        hidden_size=hidden,
        intermediate_size=_int(path, config, "intermediate_size"),
        num_layers=_int(path, config, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_int(path, config, "num_key_value_heads", heads),
        head_dim=_int(path, config, "head_dim", hidden // heads),
        rms_norm_eps=_float(path, config, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        max_position_embeddings=context,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        rope_scaling=rope_scaling,
        bos_token_id=next(iter(_token_ids(path, config.get("bos_token_id", generation.get("bos_token_id")))), None),
        eos_token_ids=_token_ids(path, generation.get("eos_token_id", config.get("eos_token_id"))),
        pooling=pooling,
        nope_layers=_nope_layers(path, config, key),
        **VARIANTS[key],
    )


def _nope_layers(path: str, config: dict[str, Any], key: str) -> tuple[int, ...]:
    """SmolLM3's layers without rotary: no_rope_layers[i] == 0, or every no_rope_layer_interval-th."""
    if key != "smollm3":
        return ()
    layers = _int(path, config, "num_hidden_layers")
    flags = config.get("no_rope_layers")
    if flags is None:
        return nope_every(_int(path, config, "no_rope_layer_interval", 4), layers)
    if not isinstance(flags, list) or len(flags) != layers or any(f not in (0, 1) for f in flags):
        raise ModelLoadError(path, f"no_rope_layers must list 0 or 1 for each of the {layers} layers")
    return tuple(i for i, use_rope in enumerate(flags) if not use_rope)


def _pooling(root: Path) -> str | None:
    """The pooling a sentence-transformers model declares (1_Pooling/config.json), if any."""
    modes = read_json(root / "1_Pooling" / "config.json", required=False)
    chosen = sorted(_POOLING.get(name, name.removeprefix("pooling_mode_")) for name, on in modes.items()
                    if name.startswith("pooling_mode_") and on is True)
    return "+".join(chosen) or None


def _window(path: str, config: dict[str, Any]) -> int | None:
    """The sliding attention window the model uses, if any (use_sliding_window false: none)."""
    if config.get("sliding_window") is None or not config.get("use_sliding_window", True):
        return None
    return _int(path, config, "sliding_window")


def _registry_key(path: str, config: dict[str, Any]) -> str:
    model_type, architectures = config.get("model_type"), config.get("architectures") or []
    if model_type in SUPPORTED_MODEL_TYPES:
        return SUPPORTED_MODEL_TYPES[model_type]
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[name]
    raise ModelLoadError(path, f"unsupported model: model_type={model_type!r}, architectures={architectures}")


def _rope(path: str, config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    # transformers >= 5 writes rope_parameters (theta and scaling together); older ones rope_theta + rope_scaling.
    params = dict(config.get("rope_parameters") or {})
    theta = config.get("rope_theta")
    theta = params.get("rope_theta", 10000.0) if theta is None else theta
    scaling = dict(config.get("rope_scaling") or params)
    scaling.pop("rope_theta", None)
    partial = config.get("partial_rotary_factor", scaling.pop("partial_rotary_factor", 1.0))
    if partial != 1:  # Phi-4-mini's 0.75: part of each head unrotated
        raise ModelLoadError(path, f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported")
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ModelLoadError(path, f"rope_theta must be a positive number, not {theta!r}")
    if scaling.get("rope_type", "default") == "default":
        return float(theta), None
    return float(theta), scaling


def _int(path: str, config: dict[str, Any], key: str, default: int | None = None) -> int:
    value = config.get(key)
    if value is None:
        if default is None:
            raise ModelLoadError(path, f"{key} is missing")
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(path, f"{key} must be a positive integer, not {value!r}")
    return value


def _float(path: str, config: dict[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(path, f"{key} must be a positive number, not {value!r}")
    return float(value)


def _token_ids(path: str, value: Any) -> tuple[int, ...]:
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ModelLoadError(path, f"token ids must be non-negative integers, not {value!r}")
    return tuple(ids)


def read_json(file: Path, required: bool) -> dict[str, Any]:
    """A model directory's JSON file as an object; {} for a missing file that is not `required`.
    ModelLoadError naming the file when it is missing but required, unreadable, or not an object."""
    if not file.is_file():
        if required:
            raise ModelLoadError(str(file), "file not found")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelLoadError(str(file), f"not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(str(file), "expected a JSON object")
    return data


def _tensor_files(root: Path) -> dict[str, Path]:
    single, index = root / SINGLE_FILE, root / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index, required=True).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelLoadError(str(index), "no weight_map object")
        shards = {f: _shard_path(root, index, f) for f in set(weight_map.values())}
        files = {name: shards[f] for name, f in weight_map.items()}
    elif single.is_file():
        files = {name: single for name in _open(single).keys()}
    else:
        raise ModelLoadError(str(root), f"neither {SINGLE_FILE} nor {INDEX_FILE} is present")
    for file in set(files.values()):
        if not file.is_file():
            raise ModelLoadError(str(file), f"shard listed in {INDEX_FILE} is missing")
    return {name: f for name, f in files.items() if not name.endswith(_IGNORED_SUFFIXES)}


def _shard_path(root: Path, index: Path, name: Any) -> Path:
    """The shard file `name` from the index names, refused unless it stays inside the model directory.

    The index is data that came with the checkpoint, so a name may not be absolute or climb out
    with `..`, and what it resolves to (symlinks followed) must lie inside the directory, or, for a
    Hugging Face hub cache snapshot (`<repo>/snapshots/<revision>`), inside that repository's `blobs`.
    """
    if not isinstance(name, str) or not name:
        raise ModelLoadError(str(index), f"weight_map names a shard that is not a file name: {name!r}")
    relative = Path(name)
    if relative.is_absolute() or relative.drive or ".." in relative.parts:
        raise ModelLoadError(str(index), f"shard path {name!r} must be relative and inside the model directory")
    real_root = root.resolve()
    allowed = [real_root]
    if real_root.parent.name == "snapshots":
        allowed.append(real_root.parent.parent / "blobs")
    target = (root / relative).resolve()
    if not any(target.is_relative_to(a) for a in allowed):
        raise ModelLoadError(str(index), f"shard {name!r} resolves to {target}, outside the model directory")
    return root / relative


def _open(file: Path) -> Any:
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(str(file), f"not a readable SafeTensors file: {e}") from e


def _shape(handle: Any, file: Path, name: str) -> tuple[int, ...]:
    if name not in handle.keys():
        raise ModelLoadError(str(file), f"tensor {name} is listed in {INDEX_FILE} but not in the file")
    info = handle.get_slice(name)
    if info.get_dtype() not in FLOAT_DTYPES:
        supported = ", ".join(FLOAT_DTYPES)
        raise ModelLoadError(str(file), f"tensor {name} has dtype {info.get_dtype()}; supported: {supported}")
    return tuple(info.get_shape())


def _read(handle: Any, file: Path, name: str, dtype: torch.dtype) -> torch.Tensor:
    try:
        return handle.get_tensor(name).to(dtype).contiguous()
    except (SafetensorError, OSError) as e:
        raise ModelLoadError(str(file), f"cannot read tensor {name}: {e}") from e
