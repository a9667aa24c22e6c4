"""LoRA adapters: PEFT checkpoints (adapter_config.json + adapter_model.safetensors) served beside
the base model, chosen per request.

An adapter adds scale * B @ A to some of a layer's projections (W x + scale B (A x), A [r, in],
B [out, r]). Forge keeps the base weights as they are (4-bit codes included) and adds each
adapter's update to the rows of the requests that chose it, after the projection: requests of
different adapters and of none share one step. The update is computed in fp32 per row (see
Backend.lora_add), so a request's tokens do not depend on what shares its step.

What an adapter may hold: LoRA on q/k/v/o and gate/up/down (or Phi-3's fused qkv_proj and
gate_up_proj), any rank up to the server's --max-lora-rank, lora_alpha with alpha_pattern and
rank-stabilised scaling. Anything else (DoRA, LoRA biases, adapted embeddings or lm_head,
modules_to_save, pickled .bin weights) is refused at load, naming it.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NoReturn

import torch
from safetensors import safe_open

from forge_service.errors import ModelLoadError
from forge_service.models.arch import ArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# A PEFT key: ...layers.<i>.<self_attn|mlp>.<module>.lora_<A|B>.weight
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass
class LoraModule:
    """One adapted module: its update, added to output columns [offset, offset + N) of its
    (possibly fused) projection."""

    a: torch.Tensor  # [r, K] fp32
    bt: torch.Tensor  # [r, N] fp32, B transposed with the scale folded in
    offset: int


@dataclass
class LoraAdapter:
    name: str
    path: str
    rank: int  # the largest module rank
    # per layer: projection ("qkv", "o_proj", "gate_up", "down") -> its adapted modules
    layers: list[dict[str, list[LoraModule]]] = field(default_factory=list)

    @property
    def num_modules(self) -> int:
        return sum(len(m) for layer in self.layers for m in layer.values())


def _projections(arch: ArchConfig) -> dict[str, tuple[str, int, int, int]]:
    """PEFT module name -> (Forge projection, output offset, output width, input width)."""
    d, hd, f = arch.hidden_size, arch.head_dim, arch.intermediate_size
    q, kv = arch.num_heads * hd, arch.num_kv_heads * hd
    names = {"o_proj": ("o_proj", 0, d, q), "down_proj": ("down", 0, d, f)}
    if arch.fused_projections:
        names.update(qkv_proj=("qkv", 0, q + 2 * kv, d), gate_up_proj=("gate_up", 0, 2 * f, d))
    else:
        names.update(q_proj=("qkv", 0, q, d), k_proj=("qkv", q, kv, d), v_proj=("qkv", q + kv, kv, d),
                     gate_proj=("gate_up", 0, f, d), up_proj=("gate_up", f, f, d))
    return names


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's alpha_pattern (a module's own lora_alpha): the first key that `module` (e.g.
    "model.layers.3.self_attn.q_proj") ends with as a dotted suffix or regex. (Its rank_pattern
    needs no reading: a module's rank is its A's rows.)"""
    for key, value in (pattern or {}).items():
        if re.fullmatch(rf"(?:.*\.)?{key}", module):
            return value
    return default


Pairs = dict[tuple[int, str], dict[str, torch.Tensor]]  # (layer, PEFT module name) -> {"A": .., "B": ..}
Scale = Callable[[int, str, int], float]  # (layer, module, rank) -> the update's scale


def load_adapter(name: str, path: str | Path, arch: ArchConfig, max_rank: int) -> LoraAdapter:
    """A LoRA adapter -> its fp32 updates in Forge's projection layout: a PEFT directory, or a
    llama.cpp adapter GGUF (convert_lora_to_gguf's). ModelLoadError naming the file and what is
    unsupported or does not fit `arch`."""
    root = Path(path)

    def fail(reason: str) -> NoReturn:
        raise ModelLoadError(str(root), f"LoRA adapter {name!r}: {reason}")

    pairs, scale_of = _gguf_pairs(root, arch, fail) if root.is_file() else _peft_pairs(name, root, arch, fail)
    if not pairs:
        fail("it holds no LoRA weights")
    projections = _projections(arch)
    adapter = LoraAdapter(name, str(root), 0, [{} for _ in range(arch.num_layers)])
    for (layer, module), ab in sorted(pairs.items()):
        if module not in projections:
            fail(f"layer {layer}: it adapts {module}, which this {arch.architecture} model does not have (it has "
                 f"{', '.join(projections)})")
        if not 0 <= layer < arch.num_layers:
            fail(f"it names layer {layer}; the model has {arch.num_layers}")
        if set(ab) != {"A", "B"}:
            fail(f"layer {layer} {module} has lora_{''.join(ab)} without its other half")
        projection, offset, out_width, in_width = projections[module]
        a, b = ab["A"].float(), ab["B"].float()
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or rank < 1 or a.shape[1] != in_width or b.shape != (out_width, rank):
            fail(f"layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; this model needs "
                 f"A [r, {in_width}] and B [{out_width}, r] (an adapter of another base model?)")
        if rank > max_rank:
            fail(f"layer {layer} {module} has rank {rank}, above --max-lora-rank {max_rank}")
        scale = scale_of(layer, module, rank)
        if not math.isfinite(scale) or not torch.isfinite(a).all() or not torch.isfinite(b).all():
            fail(f"layer {layer} {module} has a value that is not finite")
        module_update = LoraModule(a.contiguous(), (b.T * scale).contiguous(), offset)
        adapter.layers[layer].setdefault(projection, []).append(module_update)
        adapter.rank = max(adapter.rank, rank)
    return adapter


def _peft_pairs(name: str, root: Path, arch: ArchConfig, fail: Callable[[str], NoReturn]) -> tuple[Pairs, Scale]:
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config_path.is_file():
        fail(f"no {CONFIG_FILE} in {root}")
    if not weights_path.is_file():
        found = " (only adapter_model.bin, a pickle Forge does not load: save with safe_serialization)" \
            if (root / "adapter_model.bin").is_file() else ""
        fail(f"no {WEIGHTS_FILE} in {root}{found}")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as error:
        fail(f"{config_path} is not JSON: {error}")
    _check_config(name, root, config)
    pairs: Pairs = {}
    with safe_open(str(weights_path), framework="pt") as f:
        for key in f.keys():
            match = _KEY.search(key)
            if match is None:
                fail(f"{key} is not a LoRA update of a layer's attention or MLP projection (adapted "
                     "embeddings, lm_head and modules_to_save are not served)")
            pairs.setdefault((int(match[1]), match[2]), {})[match[3]] = f.get_tensor(key)

    def scale_of(layer: int, module: str, rank: int) -> float:
        block = "mlp" if module in ("gate_proj", "up_proj", "down_proj", "gate_up_proj") else "self_attn"
        alpha = _pattern_value(config.get("alpha_pattern"), f"model.layers.{layer}.{block}.{module}",
                               config.get("lora_alpha", 8))
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
            fail(f"layer {layer} {module} has lora_alpha {alpha!r} (alpha_pattern), not a number")
        return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank

    return pairs, scale_of


def _gguf_pairs(path: Path, arch: ArchConfig, fail: Callable[[str], NoReturn]) -> tuple[Pairs, Scale]:
    """llama.cpp's adapter GGUF: general.type "adapter", adapter.type "lora", adapter.lora.alpha,
    and per adapted tensor `blk.N.<name>.weight.lora_a` [r, in] and `.lora_b` [out, r], B's rows in
    llama.cpp's order (Q/K rows permuted where its general.architecture's weights are: a Llama's, a
    Mistral's)."""
    from forge_service.loaders import gguf as loader
    from forge_service.loaders.gguf_file import read_gguf

    reader = read_gguf(str(path))
    meta = loader.Metadata(str(path), reader)
    kind = meta.get("general.type", None)
    if kind != "adapter" or meta.get("adapter.type", None) != "lora":
        fail(f"a GGUF of general.type {kind!r} and adapter.type {meta.get('adapter.type', None)!r}, not a LoRA "
             "adapter (a llama.cpp LoRA GGUF says 'adapter' and 'lora')")
    if meta.get("adapter.alora.invocation_tokens", None) is not None:
        fail("an activated LoRA (adapter.alora.invocation_tokens), which applies only after its invocation, is "
             "not supported")
    architecture = meta.get("general.architecture", None)
    served = loader.SUPPORTED_ARCHITECTURES.get(architecture)
    if not (served == arch.architecture or (served, arch.architecture) == ("llama", "mistral")):  # (Mistral: llama)
        fail(f"an adapter of a {architecture!r} model, and this one is a {arch.architecture!r} model")
    alpha = float(meta.get("adapter.lora.alpha", 0.0))
    pairs: Pairs = {}
    for t in reader.tensors:
        base, dot, which = t.name.rpartition(".")
        if not dot or which not in ("lora_a", "lora_b"):
            fail(f"tensor {t.name} is not a LoRA update (its name ends in neither .lora_a nor .lora_b)")
        if t.tensor_type not in loader.DECODERS:
            fail(f"tensor {t.name} has type {t.tensor_type.name}")
        try:
            hf = loader.hf_name(str(path), base, arch.fused_projections).split(".")
        except ModelLoadError:
            hf = []
        if len(hf) != 6 or not hf[4].endswith("_proj"):  # model.layers.N.<block>.<module>.weight
            fail(f"tensor {t.name} is not a LoRA update of a layer's attention or MLP projection")
        layer, module = hf[2], hf[4]
        value = loader.DECODERS[t.tensor_type](t).float()
        if which == "lora_b" and architecture in loader.PERMUTED_QK and module in ("q_proj", "k_proj"):
            value = loader.unpermute_qk(value, arch.num_heads if module == "q_proj" else arch.num_kv_heads)
        pairs.setdefault((int(layer), module), {})["A" if which == "lora_a" else "B"] = value

    def scale_of(layer: int, module: str, rank: int) -> float:
        return alpha / rank if alpha else 1.0  # llama.cpp's: no alpha, no scaling

    return pairs, scale_of


def _check_config(name: str, root: Path, config: dict) -> None:
    def refuse(what: str) -> NoReturn:
        raise ModelLoadError(str(root), f"LoRA adapter {name!r}: {what} is not supported")

    if not isinstance(config, dict):
        refuse("an adapter_config.json that is not an object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        refuse(f"peft_type {config.get('peft_type')!r} (LoRA only)")
    if config.get("use_dora"):
        refuse("DoRA (use_dora)")
    if config.get("bias", "none") != "none":
        refuse(f"bias {config.get('bias')!r} (LoRA adapters without biases only)")
    if config.get("fan_in_fan_out"):
        refuse("fan_in_fan_out")
    if config.get("modules_to_save"):
        refuse(f"modules_to_save {config['modules_to_save']!r}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        refuse(f"lora_alpha {alpha!r}")
