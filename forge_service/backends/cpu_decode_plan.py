"""A whole bf16 step's decoder layers in one native call (native/cpu/decode.c): the per-kernel
path's kernels (cpu_kernels.py), in its order and with its arguments, so the same bits."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from forge_service.backends import cpu_kernels
from forge_service.backends.cpu_kernels import FINE_ABOVE, ROWS, QuantWeight, bf16, head_dim_supported, \
    lora_shape, ptr


class _Weight(ctypes.Structure):
    _fields_ = [("codes", ctypes.c_void_p), ("scale", ctypes.c_void_p), ("offset", ctypes.c_void_p),
                ("n", ctypes.c_int64), ("k", ctypes.c_int64), ("levels", ctypes.c_int32),
                ("fine_above", ctypes.c_float)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("qkv", _Weight), ("o", _Weight),
                ("gate_up", _Weight), ("down", _Weight), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("qkv_bias", ctypes.c_void_p), ("q_norm", ctypes.c_void_p), ("k_norm", ctypes.c_void_p),
                ("rope", ctypes.c_int64)]


class _LoraModule(ctypes.Structure):
    _fields_ = [("a", ctypes.c_void_p), ("bt", ctypes.c_void_p), ("rank", ctypes.c_int64), ("n", ctypes.c_int64),
                ("offset", ctypes.c_int64)]


class _LoraTable(ctypes.Structure):
    _fields_ = [("modules", ctypes.c_void_p), ("first", ctypes.c_void_p)]


class _LoraRows(ctypes.Structure):
    _fields_ = [("table", ctypes.c_void_p), ("rows", ctypes.c_void_p), ("count", ctypes.c_int64)]


_PROJECTIONS = ("qkv", "o_proj", "gate_up", "down")  # decode.c's P_QKV .. P_DOWN


class _Dims(ctypes.Structure):
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64), ("kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("intermediate", ctypes.c_int64), ("block_size", ctypes.c_int64),
                ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


@dataclass
class DecodeLayer:
    """One decoder layer's weights as the fused step call takes them: bf16 norms and each
    projection in the native layout with its activation levels."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: tuple[QuantWeight, int]  # (weight, levels)
    o: tuple[QuantWeight, int]
    gate_up: tuple[QuantWeight, int]
    down: tuple[QuantWeight, int]
    qkv_bias: torch.Tensor | None = None  # bf16 [(H + 2 Hkv) hd] (Qwen2)
    q_norm: torch.Tensor | None = None  # bf16 [hd] each (Qwen3)
    k_norm: torch.Tensor | None = None
    rope: bool = True  # False: no rotary embedding (SmolLM3's NoPE layers)


class DecodePlan:
    """Runs every layer of a step in one native call, its decode rows and prefill chunks alike: the
    per-kernel path's kernels, in its order and with its arguments (so the same bits), without ~11
    Python round trips per layer (about 2 ms a step on the default model)."""

    def __init__(self, layers: list[DecodeLayer], hidden: int, heads: int, kv_heads: int, head_dim: int,
                 intermediate: int, eps: float, scale: float) -> None:
        self.layers = layers  # keeps the weights the structs point at alive
        self.max_rows = None  # any decode step: the native GEMMs take every batch size
        # The GEMMs take a step's rows in blocks of ROWS: a row that opens a block costs the block's
        # pass over every weight, several rows' worth (see Scheduler's row_block).
        self.row_block = ROWS
        self.dims = _Dims(hidden, heads, kv_heads, head_dim, intermediate, 0, eps, scale)
        self.table = (_Layer * len(layers))()
        for row, layer in zip(self.table, layers):
            row.input_norm = layer.input_norm.data_ptr()
            row.post_norm = layer.post_norm.data_ptr()
            row.qkv_bias, row.q_norm, row.k_norm = ptr(layer.qkv_bias), ptr(layer.q_norm), ptr(layer.k_norm)
            row.rope = int(layer.rope)
            for name in ("qkv", "o", "gate_up", "down"):
                w, levels = getattr(layer, name)
                setattr(row, name, _Weight(w.codes.data_ptr(), w.scale.data_ptr(),
                                           ptr(w.offset), w.shape[0], w.shape[1], levels, FINE_ABOVE))
        self._caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._adapters: list[tuple[_LoraTable, object]] = []  # each LoRA adapter's table, and what it points at

    def add_adapter(self, adapter) -> None:
        """Take a LoRA adapter (forge_service/lora.py), which AttentionMetadata.lora then names by
        its 1-based index in the order added: its updates are added in the call, after each
        projection, as the per-kernel path adds them."""
        modules, first = [], [0]
        for layer in adapter.layers:
            for name in _PROJECTIONS:
                for m in layer.get(name, ()):
                    if not (m.a.is_contiguous() and m.bt.is_contiguous()
                            and lora_shape(m.a.shape[1], m.bt.shape[1], m.a.shape[0])):
                        raise ValueError(f"LoRA adapter {adapter.name!r}: a module the fused step cannot take")
                    modules.append(_LoraModule(m.a.data_ptr(), m.bt.data_ptr(), m.a.shape[0], m.bt.shape[1],
                                               m.offset))
                first.append(len(modules))
        array = (_LoraModule * max(1, len(modules)))(*modules)
        starts = torch.tensor(first, dtype=torch.int64)
        self._adapters.append((_LoraTable(ctypes.addressof(array), starts.data_ptr()), (adapter, array, starts)))

    @staticmethod
    def supported(layers: list[DecodeLayer], hidden: int, intermediate: int, head_dim: int) -> bool:
        """Whether every kernel of the call takes these shapes (as norm_supported, silu_mul_supported
        and attention_supported say for the per-kernel path)."""
        extras = [t for layer in layers for t in (layer.qkv_bias, layer.q_norm, layer.k_norm) if t is not None]
        return (cpu_kernels.library() is not None and hidden % 16 == 0 and intermediate % 16 == 0
                and head_dim_supported(head_dim) and all(bf16(layer.input_norm, layer.post_norm) for layer in layers)
                and all(bf16(t) and t.is_contiguous() for t in extras))

    def takes(self, meta, tokens: int) -> bool:
        """Whether this step is one the plan runs: any, given its decode rows' context lengths."""
        return meta.num_decode_tokens == 0 or meta.decode_lens is not None

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta) -> torch.Tensor:
        """x [T, D] fp32 embeddings, updated in place; cos, sin [T, 1, hd] bf16 -> the last layer's
        MLP output [T, D] bf16, still to be added to x."""
        if not bf16(cos, sin):
            raise ValueError("the fused step takes bf16 rotary tables")
        if kv_caches is not self._caches:
            if len(kv_caches) != len(self.layers):
                raise ValueError(f"{len(kv_caches)} caches for {len(self.layers)} layers")
            for row, (k_cache, v_cache) in zip(self.table, kv_caches):
                if not (bf16(k_cache, v_cache) and k_cache.is_contiguous() and v_cache.is_contiguous()):
                    raise ValueError("the fused step takes contiguous bf16 caches")
                row.k_cache, row.v_cache = k_cache.data_ptr(), v_cache.data_ptr()
            self._caches = kv_caches
        self.dims.block_size = meta.block_size
        t, decodes = x.shape[0], meta.num_decode_tokens
        delta = torch.empty(t, x.shape[1], dtype=torch.bfloat16)
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        tables = lens = None
        if decodes:
            tables = meta.decode_block_tables.to(torch.int64).contiguous()
            lens = meta.decode_lens.to(torch.int32).contiguous()
        chunks = context = None
        if meta.prefills:  # each chunk: its first row, its rows, its context (its own tokens last)
            contexts = [slots[s.q_start:s.q_end] if s.ctx_slots is None else s.ctx_slots.to(torch.int64)
                        for s in meta.prefills]
            chunks = torch.tensor([[s.q_start, s.q_end - s.q_start, len(c)] for s, c in zip(meta.prefills, contexts)],
                                  dtype=torch.int64)
            context = torch.cat(contexts).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        lora = (_LoraRows * max(1, len(meta.lora)))(*(
            _LoraRows(ctypes.addressof(self._adapters[index - 1][0]), rows.data_ptr(), rows.shape[0])
            for index, rows in meta.lora))  # meta.lora's rows: contiguous int64, alive through the call
        status = cpu_kernels.library().forge_decode_layers(
            ctypes.byref(self.table), len(self.layers), ctypes.byref(self.dims), x.data_ptr(), delta.data_ptr(), t,
            slots.data_ptr(), cos.data_ptr(), sin.data_ptr(), decodes, ptr(tables),
            0 if tables is None else tables.shape[1], ptr(lens), len(meta.prefills), ptr(chunks), ptr(context),
            lora, len(meta.lora), torch.get_num_threads())
        if status:
            raise ValueError({1: "unsupported shapes", 2: "out of memory"}.get(status, f"status {status}"))
        return delta
