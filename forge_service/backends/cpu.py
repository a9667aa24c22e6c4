"""The CPU backend: torch (torch_ref.py, the reference every other backend is tested against) and,
in bf16, the native kernels of cpu_kernels.py."""
from __future__ import annotations

from typing import Any, Sequence

import torch

from forge_service.backends import cpu_decode_plan, cpu_kernels, cpu_linear, torch_ref
from forge_service.backends.base import AttentionMetadata, Forward, QuantCodes
from forge_service.backends.cpu_linear import CpuWeight
from forge_service.sampling import Sampler


class CpuBackend:
    """Paged KV writes and attention over a flat batch mixing decodes and prefill chunks, and the
    model's other ops in plain torch: the reference for every other backend.

    In bf16, the norms, SiLU, rotary and attention run on the native kernels of cpu_kernels where
    they can: one call each instead of up to fifteen torch ops, and attention in fp32. fp32, the
    reference, always runs in torch."""

    name = "cpu"
    device = torch.device("cpu")

    # ---- weights ----
    @staticmethod
    def pack_linear(weight: torch.Tensor, codes: QuantCodes | None, int8_rows: bool) -> CpuWeight | None:
        return cpu_linear.pack(weight, codes, int8_rows)

    @staticmethod
    def needs_dense(packed: CpuWeight | None) -> bool:
        return cpu_linear.needs_dense(packed)

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor | None, packed: CpuWeight | None) -> torch.Tensor:
        return cpu_linear.linear(x, weight, packed)  # the native kernels, else torch's 4-bit / int8 or dense

    @staticmethod
    def linear_widened(x: torch.Tensor, weight: torch.Tensor | None, packed: CpuWeight | None) -> torch.Tensor:
        return cpu_linear.linear_widened(x, weight, packed)  # the native GEMMs store fp32 themselves

    # ---- per-layer ops ----
    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if cpu_kernels.norm_supported(x, weight):
            return cpu_kernels.add_rms_norm(x, None, weight, eps)
        return torch_ref.rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # residual += delta in place (as `residual + delta` rounds), then its norm
        if delta.dtype == torch.bfloat16 and cpu_kernels.norm_supported(residual, weight):
            return cpu_kernels.add_rms_norm(residual, delta, weight, eps)
        return torch_ref.rms_norm(residual.add_(delta), weight, eps)

    @staticmethod
    def final_norm(x: torch.Tensor, delta: torch.Tensor | None, rows: torch.Tensor, weight: torch.Tensor,
                   eps: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if cpu_kernels.final_norm_supported(x, delta, weight, dtype):  # one call for the gather, add, norm, cast
            return cpu_kernels.final_norm(x, delta, rows, weight, eps)
        return torch_ref.final_norm(x, delta, rows, weight, eps, dtype)

    @staticmethod
    def head_rms_norm(qk: torch.Tensor, num_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        if cpu_kernels.head_norm_supported(qk, q_weight) and cpu_kernels.head_norm_supported(qk, k_weight):
            cpu_kernels.head_rms_norm_(qk, num_heads, q_weight, k_weight, eps)  # in place: the fresh projection
            return qk
        return torch_ref.head_rms_norm(qk, num_heads, q_weight, k_weight, eps)

    @staticmethod
    def lora_add(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> None:
        if cpu_kernels.lora_supported(y, x, a):
            cpu_kernels.lora_add_(y, x, rows, a, bt)
        else:
            torch_ref.lora_add(y, x, rows, a, bt)

    @staticmethod
    def refine_leaders(logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, k: int) -> None:
        if cpu_kernels.refine_supported(logits, h, weight, k):  # one call: the scan, the dots, the writes
            cpu_kernels.refine_top_(logits, h, weight, k)
        else:
            torch_ref.refine_leaders(logits, h, weight, k)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.silu_mul_supported(gate_up):
            return cpu_kernels.silu_mul(gate_up)
        return torch_ref.silu_and_mul(gate_up)

    @staticmethod
    def rotary_tables(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return torch_ref.rotary_tables(cos, sin, positions, dtype)  # cos, sin: [T, 1, hd]

    @staticmethod
    def rotary(qk: torch.Tensor, num_heads: int, tables: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # qk: [T, H + Hkv, hd], the query heads then the key heads -> q [T, H, hd], k [T, Hkv, hd].
        # Rotated together: one set of elementwise ops instead of two.
        cos, sin = tables
        if cpu_kernels.rotary_supported(qk, cos, sin):
            cpu_kernels.rotary_(qk, cos, sin)  # in place: qk is this step's fresh projection
        else:
            qk = torch_ref.apply_rotary(qk, cos, sin)
        q, k = qk.split([num_heads, qk.shape[1] - num_heads], dim=1)
        return q, k

    @staticmethod
    def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        torch_ref.write_kv(k_cache, v_cache, k, v, slot_mapping)

    @staticmethod
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [T, H, hd]; k, v: [T, Hkv, hd] (this step's tokens, already in the cache) -> [T, H * hd]
        out = torch.empty(q.shape, dtype=q.dtype)
        d = meta.num_decode_tokens
        native = cpu_kernels.attention_supported(q, k_cache)
        if d:
            if native and meta.decode_lens is not None:
                out[:d] = cpu_kernels.decode_attention(q[:d], k_cache, v_cache, meta.decode_block_tables,
                                                       meta.decode_lens, meta.block_size, scale)
            else:
                out[:d] = torch_ref.decode_attention(q[:d], k_cache, v_cache, meta, scale)
        for seq in meta.prefills:
            if native:  # straight into its rows of `out`
                slots = meta.slot_mapping[seq.q_start:seq.q_end] if seq.ctx_slots is None else seq.ctx_slots
                cpu_kernels.prefill_attention(q[seq.q_start:seq.q_end], k_cache, v_cache, slots, scale,
                                              out[seq.q_start:seq.q_end])
            else:
                out[seq.q_start:seq.q_end] = torch_ref.prefill_attention(q, k, v, k_cache, v_cache, seq, scale)
        return out.flatten(1)

    @staticmethod
    def decode_plan(layers: Sequence[Any], arch: Any, scale: float) -> cpu_decode_plan.DecodePlan | None:
        """Every layer of a step (decode rows and prefill chunks) in one native call, where the
        kernels serve each part of these layers (bf16, every projection in a native 4-bit or int8
        form); None elsewhere."""
        names = ("qkv", "o_proj", "gate_up", "down")
        packed = [[getattr(layer, n).packed for n in names] for layer in layers]
        if any(w is None or w.native is None for ws in packed for w in ws):
            return None
        plan = [cpu_decode_plan.DecodeLayer(layer.input_norm, layer.post_norm, *((w.native, w.levels) for w in ws),
                                            layer.qkv_bias, layer.q_norm, layer.k_norm, layer.rope)
                for layer, ws in zip(layers, packed)]
        if not cpu_decode_plan.DecodePlan.supported(plan, arch.hidden_size, arch.intermediate_size, arch.head_dim):
            return None
        return cpu_decode_plan.DecodePlan(plan, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                          arch.intermediate_size, arch.rms_norm_eps, scale)

    # ---- per step and at start-up ----
    @staticmethod
    def prepare(meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    @staticmethod
    def sampler() -> Sampler:
        return Sampler()

    @staticmethod
    def startup(forward: Forward, arch: Any, dtype: torch.dtype, block_size: int, max_batch: int,
                max_len: int) -> None:
        """Nothing to prepare on the CPU (the CUDA backend captures its decode graphs here)."""

    @staticmethod
    def run(forward: Forward, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logit_rows: torch.Tensor) -> torch.Tensor:
        return forward(input_ids, positions, meta, logit_rows)
