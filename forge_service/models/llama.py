"""Llama in plain torch over a flat batch: prefill chunks and decode tokens in one forward."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from forge_service.backends.base import AttentionMetadata, Backend, Int8Weight, QuantCodes
from forge_service.layers.linear import Linear
from forge_service.layers.rotary import RotaryEmbedding
from forge_service.lora import LoraAdapter
from forge_service.models.arch import ArchConfig


REFINE_CANDIDATES = 8


@dataclass
class LlamaLayer:
    input_norm: torch.Tensor  # [D]
    qkv: Linear  # [(H + 2 Hkv) * hd, D], fused at load time
    o_proj: Linear  # [D, H * hd]
    post_norm: torch.Tensor  # [D]
    gate_up: Linear  # [2 F, D], fused at load time
    down: Linear  # [D, F]
    qkv_bias: torch.Tensor | None = None  # [(H + 2 Hkv) * hd] (Qwen2)
    q_norm: torch.Tensor | None = None  # [hd], each query head's RMSNorm weight (Qwen3)
    k_norm: torch.Tensor | None = None  # [hd], each key head's
    rope: bool = True  # False: a NoPE layer (SmolLM3), no rotary embedding


class LlamaModel:
    """Weights plus a forward; knows nothing of requests, only of a flat token batch."""

    def __init__(self, arch: ArchConfig, weights: dict[str, torch.Tensor], backend: Backend,
                 codes: dict[str, QuantCodes] | None = None,
                 decoders: dict[str, Callable[[], torch.Tensor]] | None = None) -> None:
        self.arch = arch
        self.backend = backend
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.embed = weights["model.embed_tokens.weight"]  # [V, D]
        # [V, D], kept dense for refining the leading logits (the embedding itself when tied). A
        # backend may read it as int8 for the full product: its leading logits are refined anyway.
        self.lm_head_weight = weights.get("lm_head.weight", self.embed)
        self.lm_head = Linear(backend, self.lm_head_weight, int8_rows=True)
        self.norm = weights["model.norm.weight"].float()  # the final norm runs in fp32 throughout
        self.layers = [self._layer(weights, codes or {}, decoders or {}, i) for i in range(arch.num_layers)]
        self.rotary = RotaryEmbedding(arch.head_dim, arch.max_position_embeddings, arch.rope_theta,
                                      arch.rope_scaling, weights.get("model.rope_freq_factors"))
        self.scale = arch.head_dim ** -0.5
        self.last_hidden: torch.Tensor | None = None  # set by each forward
        # LoRA adapters (forge_service/lora.py), added by the engine; AttentionMetadata.lora names
        # each step's rows that take one, by 1-based index into this list.
        self.adapters: list[LoraAdapter] = []
        # The CPU backend runs a whole step's layers in one native call where it can.
        self.decode_plan = backend.decode_plan(self.layers, arch, self.scale)

    def add_adapter(self, adapter: LoraAdapter) -> None:
        """Serve a LoRA adapter: a step's meta.lora names it by its 1-based index, in the order added."""
        self.adapters.append(adapter)
        if self.decode_plan is not None:
            self.decode_plan.add_adapter(adapter)

    def _layer(self, w: dict[str, torch.Tensor], codes: dict[str, QuantCodes],
               decoders: dict[str, Callable[[], torch.Tensor]], i: int) -> LlamaLayer:
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."

        def fused(names: tuple[str, ...], dense: bool) -> torch.Tensor:
            # The weight of `names` together; with `dense`, parts not decoded yet are decoded now.
            parts = [decoders[n]() if dense and w[n].is_meta else w[n] for n in names]
            if len(parts) == 1:
                return parts[0]
            if all(part.is_meta for part in parts):  # its shape (torch.cat of meta tensors imports torch._dynamo)
                rows = sum(part.shape[0] for part in parts)
                return torch.empty((rows, *parts[0].shape[1:]), dtype=parts[0].dtype, device="meta")
            return torch.cat(parts)

        def linear(*names: str) -> Linear:
            # Fused when several. Parts quantised alike keep their codes; parts of mixed kinds (a
            # Q4_K_M file's Q4_K q/k beside a Q6_K v) are re-quantised to int8 per 32 inputs
            # together, within half a step of the file's values; unquantised parts stay dense.
            parts = [codes.get(n) for n in names]
            if None in parts:
                return Linear(self.backend, fused(names, dense=True))
            kind = type(parts[0])
            if any(type(p) is not kind for p in parts):
                weight = fused(names, dense=True)
                return Linear(self.backend, weight, Int8Weight.quantize(weight))
            return Linear(self.backend, fused(names, dense=False), kind.cat(parts) if len(parts) > 1 else parts[0],
                          dense=lambda: fused(names, dense=True))

        bias = None
        if self.arch.qkv_bias:
            bias = torch.cat([w[attn + f"{x}_proj.bias"] for x in "qkv"]).contiguous()
        prefused = self.arch.fused_projections  # Phi-3's checkpoint fused them itself
        return LlamaLayer(
            input_norm=w[p + "input_layernorm.weight"],
            qkv=linear(attn + "qkv_proj.weight") if prefused else
            linear(attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight"),
            o_proj=linear(attn + "o_proj.weight"),
            post_norm=w[p + "post_attention_layernorm.weight"],
            gate_up=linear(mlp + "gate_up_proj.weight") if prefused else
            linear(mlp + "gate_proj.weight", mlp + "up_proj.weight"),
            down=linear(mlp + "down_proj.weight"),
            qkv_bias=bias,
            q_norm=w.get(attn + "q_norm.weight"),
            k_norm=w.get(attn + "k_norm.weight"),
            rope=i not in self.arch.nope_layers,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        # input_ids, positions: [T]; logits_indices: [N] rows that need logits -> logits [N, V] float32
        # The residual stream stays fp32 whatever the compute dtype: in bf16 this keeps greedy
        # outputs much closer to fp32 at the cost of two casts per layer.
        x = self.embed[input_ids].float()  # [T, D]
        rope = self.backend.rotary_tables(self.rotary.cos, self.rotary.sin, positions, self.dtype)
        if self.decode_plan is not None and self.decode_plan.takes(meta, x.shape[0]):
            delta = self.decode_plan(x, *rope, kv_caches, meta)  # the loop below, in one native call
        else:
            lora = getattr(meta, "lora", None)
            delta = None  # the last sublayer's output, added to x by the next norm (fused on GPU)
            for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
                adapted = [(self.adapters[index - 1].layers[i], rows) for index, rows in lora or ()]
                h = self._add_norm(x, delta, layer.input_norm)
                delta = self._attention(layer, h, rope, k_cache, v_cache, meta, adapted)
                delta = self._mlp(layer, self._add_norm(x, delta, layer.post_norm), adapted)
        # [N, D] fp32, and in the compute dtype for the lm_head
        h, h_low = self.backend.final_norm(x, delta, logits_indices, self.norm, self.arch.rms_norm_eps, self.dtype)
        self.last_hidden = h  # the rows' final hidden states, for embeddings (ModelRunner._embed)
        logits = self.lm_head.widened(h_low)  # [N, V] fp32
        if self.dtype != torch.float32:
            self._refine_leaders(h, logits)
        return logits

    def _refine_leaders(self, h: torch.Tensor, logits: torch.Tensor) -> None:
        # A bf16 GEMM rounds every logit to 8 mantissa bits, enough to flip near ties: recompute
        # the leading candidates of each row in fp32 (a full fp32 lm_head costs ~3x as much).
        self.backend.refine_leaders(logits, h, self.lm_head_weight, REFINE_CANDIDATES)

    def _add_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> torch.Tensor:
        # x (fp32 residual stream) += delta in place, then RMSNorm -> [T, D] in weight's dtype
        if delta is None:
            return self.backend.rms_norm(x, weight, self.arch.rms_norm_eps)
        return self.backend.add_rms_norm(x, delta, weight, self.arch.rms_norm_eps)

    def _project(self, linear: Linear, name: str, x: torch.Tensor, adapted: list) -> torch.Tensor:
        # linear(x), plus each adapter's update of projection `name` in the rows that chose it
        y = linear(x)
        for modules, rows in adapted:
            for m in modules.get(name, ()):
                self.backend.lora_add(y[:, m.offset:m.offset + m.bt.shape[1]], x, rows, m.a, m.bt)
        return y

    def _attention(self, layer: LlamaLayer, h: torch.Tensor, rope, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   meta: AttentionMetadata, adapted: list) -> torch.Tensor:
        a = self.arch
        t = h.shape[0]
        qkv = self._project(layer.qkv, "qkv", h, adapted)
        if layer.qkv_bias is not None:
            qkv += layer.qkv_bias  # in place: the projection's fresh output, rounded as a bf16 sum
        qk, v = qkv.split([(a.num_heads + a.num_kv_heads) * a.head_dim, a.num_kv_heads * a.head_dim], dim=-1)
        qk = qk.view(t, a.num_heads + a.num_kv_heads, a.head_dim)
        if layer.q_norm is not None:
            qk = self.backend.head_rms_norm(qk, a.num_heads, layer.q_norm, layer.k_norm, a.rms_norm_eps)
        if layer.rope:
            q, k = self.backend.rotary(qk, a.num_heads, rope)  # [T, H, hd], [T, Hkv, hd]
        else:
            q, k = qk.split([a.num_heads, a.num_kv_heads], dim=1)
        v = v.view(t, a.num_kv_heads, a.head_dim)
        self.backend.write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        o = self.backend.attention(q, k, v, k_cache, v_cache, meta, self.scale)  # [T, H * hd]
        return self._project(layer.o_proj, "o_proj", o, adapted)

    def _mlp(self, layer: LlamaLayer, h: torch.Tensor, adapted: list) -> torch.Tensor:
        up = self.backend.silu_and_mul(self._project(layer.gate_up, "gate_up", h, adapted))
        return self._project(layer.down, "down", up, adapted)
