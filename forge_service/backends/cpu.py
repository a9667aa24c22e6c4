"""The CPU backend (torch): the reference every other backend is tested against."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from forge_service.backends import cpu_kernels
from forge_service.layers.attention import AttentionMetadata
from forge_service.layers.norm import rms_norm
from forge_service.layers.rotary import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:  # layers.linear imports this package for its native kernels
    from forge_service.layers.linear import Linear


class CpuBackend:
    """Paged KV writes and attention over a flat batch mixing decodes and prefill chunks, and the
    model's other ops in plain torch: the reference for every other backend.

    In bf16, the norms, SiLU, rotary and attention run on the native kernels of cpu_kernels where
    they can: one call each instead of up to fifteen torch ops, and attention in fp32. fp32, the
    reference, always runs in torch."""

    name = "cpu"
    device = torch.device("cpu")

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if cpu_kernels.norm_supported(x, weight):
            return cpu_kernels.add_rms_norm(x, None, weight, eps)
        return rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # residual += delta in place (as `residual + delta` rounds), then its norm
        if delta.dtype == torch.bfloat16 and cpu_kernels.norm_supported(residual, weight):
            return cpu_kernels.add_rms_norm(residual, delta, weight, eps)
        return rms_norm(residual.add_(delta), weight, eps)

    @staticmethod
    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.silu_mul_supported(gate_up):
            return cpu_kernels.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # [T, F] each
        return F.silu(gate) * up

    @staticmethod
    def linear(x: torch.Tensor, layer: Linear) -> torch.Tensor:
        return layer(x)  # the dense GEMM, or a small batch's 4-bit / int8 kernel

    @staticmethod
    def decode_plan(layers: list, arch: Any, scale: float) -> cpu_kernels.DecodePlan | None:
        """Every layer of a decode step in one native call, where the kernels serve each part of
        these layers (bf16, every projection in a native 4-bit or int8 form); None elsewhere."""
        from forge_service.layers.linear import NATIVE_MAX_ROWS

        names = ("qkv", "o_proj", "gate_up", "down")
        if any(getattr(layer, name).native is None for layer in layers for name in names):
            return None
        plan = [cpu_kernels.DecodeLayer(layer.input_norm, layer.post_norm,
                                        *((getattr(layer, n).native, getattr(layer, n).levels) for n in names))
                for layer in layers]
        if not cpu_kernels.DecodePlan.supported(plan, arch.hidden_size, arch.intermediate_size, arch.head_dim):
            return None
        return cpu_kernels.DecodePlan(plan, arch.hidden_size, arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                      arch.intermediate_size, arch.rms_norm_eps, scale, NATIVE_MAX_ROWS)

    @staticmethod
    def rotary_tables(rope: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        return rope.tables(positions, dtype)  # cos, sin: [T, 1, hd], shared by every layer of a step

    @staticmethod
    def rotary(qk: torch.Tensor, num_heads: int, tables: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # qk: [T, H + Hkv, hd], the query heads then the key heads -> q [T, H, hd], k [T, Hkv, hd].
        # Rotated together: one set of elementwise ops instead of two.
        cos, sin = tables
        if cpu_kernels.rotary_supported(qk, cos, sin):
            cpu_kernels.rotary_(qk, cos, sin)  # in place: qk is this step's fresh projection
        else:
            qk = apply_rotary(qk, cos, sin)
        q, k = qk.split([num_heads, qk.shape[1] - num_heads], dim=1)
        return q, k

    @staticmethod
    def prepare(meta: AttentionMetadata) -> AttentionMetadata:
        return meta

    @staticmethod
    def sampler():
        from forge_service.sampling import Sampler

        return Sampler()

    @staticmethod
    def startup(forward: Callable, arch: Any, dtype: torch.dtype, block_size: int, max_batch: int,
                max_len: int) -> None:
        """Nothing to prepare on the CPU (the CUDA backend captures its decode graphs here)."""

    @staticmethod
    def run(forward: Callable, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            logit_rows: torch.Tensor) -> torch.Tensor:
        return forward(input_ids, positions, meta, logit_rows)

    @staticmethod
    def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        # caches: [S, Hkv, hd] (S = num_blocks * block_size); k, v: [T, Hkv, hd]
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, v)

    @staticmethod
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [T, H, hd]; k, v: [T, Hkv, hd] (this step's tokens, already in the cache) -> [T, H * hd]
        out = torch.empty(q.shape, dtype=q.dtype)
        d = meta.num_decode_tokens
        if d:
            out[:d] = _decode(q[:d], k_cache, v_cache, meta, scale)
        native = cpu_kernels.attention_supported(q, k_cache)
        for seq in meta.prefills:
            if native:  # straight into its rows of `out`
                slots = meta.slot_mapping[seq.q_start:seq.q_end] if seq.ctx_slots is None else seq.ctx_slots
                cpu_kernels.prefill_attention(q[seq.q_start:seq.q_end], k_cache, v_cache, slots, scale,
                                              out[seq.q_start:seq.q_end])
            else:
                out[seq.q_start:seq.q_end] = _prefill(q, k, v, k_cache, v_cache, seq, scale)
        return out.flatten(1)


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
            scale: float) -> torch.Tensor:
    # q: [D, H, hd] -> [D, H, hd]; keys gathered through block tables
    if meta.decode_lens is not None and cpu_kernels.attention_supported(q, k_cache):
        return cpu_kernels.decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_lens,
                                            meta.block_size, scale)
    if q.dtype != torch.float32:
        return _decode_grouped(q, k_cache, v_cache, meta, scale)
    keys = _gather_blocks(k_cache, meta.decode_block_tables, meta.block_size).transpose(1, 2)  # [D, Hkv, Lmax, hd]
    values = _gather_blocks(v_cache, meta.decode_block_tables, meta.block_size).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                       scale=scale, enable_gqa=True)
    return o.squeeze(2)


def _decode_grouped(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    # In bf16, two batched matmuls with an fp32 softmax run ~2.5x faster than the CPU flash kernel
    # for one query token (measured at batch 64); fp32 keeps the flash kernel, the reference path.
    # A lone row multiplies in fp32: a bf16 batched matmul costs ~45 us however small, fp32 ~20.
    d, h, hd = q.shape
    dtype = q.dtype
    keys = _gather_blocks(k_cache, meta.decode_block_tables, meta.block_size)  # [D, Lmax, Hkv, hd]
    values = _gather_blocks(v_cache, meta.decode_block_tables, meta.block_size)
    if d == 1:
        q, keys, values = q.float(), keys.float(), values.float()
    hkv = keys.shape[2]
    scores = torch.matmul(q.view(d, hkv, h // hkv, hd), keys.permute(0, 2, 3, 1)).float() * scale  # [D, Hkv, g, L]
    scores.masked_fill_(~meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values.transpose(1, 2)).reshape(d, h, hd)  # [D, Hkv, g, hd] -> [D, H, hd]
    return out.to(dtype)


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    # cache: [S, Hkv, hd] with S = num_blocks * bs; tables: [D, W] -> [D, W * bs, Hkv, hd].
    # Copying whole blocks (one contiguous row each) is ~2x faster than gathering slot by slot.
    d, w = tables.shape
    _, hkv, hd = cache.shape
    blocks = cache.view(-1, block_size * hkv * hd)  # [num_blocks, bs * Hkv * hd]
    return torch.index_select(blocks, 0, tables.flatten()).view(d, w * block_size, hkv, hd)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, seq, scale: float) -> torch.Tensor:
    qs = q[seq.q_start:seq.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, L, hd]
    if seq.ctx_slots is None:
        keys = k[seq.q_start:seq.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, hd]
        values = v[seq.q_start:seq.q_end].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        keys = k_cache[seq.ctx_slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, C, hd]
        values = v_cache[seq.ctx_slots].transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=seq.mask, scale=scale, enable_gqa=True)
    return o.squeeze(0).transpose(0, 1)  # [L, H, hd]


def _cuda_backend() -> Any:
    # Imported on demand: Forge imports without cuda-python or a GPU.
    from forge_service.backends.cuda.backend import CudaBackend

    return CudaBackend()


BACKENDS: dict[str, Callable[[], Any]] = {"cpu": CpuBackend, "cuda": _cuda_backend}
