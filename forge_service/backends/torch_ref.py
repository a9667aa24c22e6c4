"""The model's ops in plain torch, on any device: the reference numerics.

The CPU backend runs these where its native kernels do not serve (always in fp32, the reference);
the CUDA backend calls prefill_attention for fp32 prefill chunks. Kernel tests compare against them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from forge_service.backends.base import AttentionMetadata, PrefillSeq
from forge_service.sampling import ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: [T, D] (any float dtype), weight: [D] -> [T, D] in weight's dtype (HF Llama: normalise in
    # fp32, scale in the compute dtype)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(weight.dtype)


def final_norm(x: torch.Tensor, delta: torch.Tensor | None, rows: torch.Tensor, weight: torch.Tensor, eps: float,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # Backend.final_norm in torch ops: x[rows] (+ delta[rows]), its rms_norm (an fp32 weight: fp32
    # throughout), and that in `dtype`
    h = rms_norm(x[rows] if delta is None else x[rows] + delta[rows], weight, eps)
    return h, h.to(dtype)


def head_rms_norm(qk: torch.Tensor, num_heads: int, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    # qk: [T, H + Hkv, hd] -> each query head normalised with q_weight [hd], each key head with
    # k_weight (Qwen3's q_norm / k_norm; HF's roundings, as rms_norm)
    q, k = qk.split([num_heads, qk.shape[1] - num_heads], dim=1)
    return torch.cat([rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)], dim=1)


def lora_add(y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, a: torch.Tensor, bt: torch.Tensor) -> None:
    # y[rows] += (x[rows] @ a.T) @ bt, in fp32 and rounded once to y's dtype
    y[rows] = (y[rows].float() + (x[rows].float() @ a.T) @ bt).to(y.dtype)


def refine_leaders(logits: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    """Each row's k largest logits [N, V] in place <- the fp32 dot of the row of h [N, D] with those
    rows of weight [V, D]."""
    top = ops.topk(logits, k)[1]  # [N, k]; 3x torch.topk on CPU at 16 rows
    # A product and a sum per row, not einsum: a batched GEMM may pick its kernel by the batch
    # size, and a row's logits must not depend on the rows beside it.
    exact = (weight[top].float() * h[:, None, :]).sum(-1)
    logits.scatter_(1, top, exact)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)  # [T, F] each
    return F.silu(gate) * up


def rotary_tables(cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # cos, sin: [P, hd] fp32; positions: [T] -> cos, sin: [T, 1, hd] in dtype
    return cos[positions].to(dtype).unsqueeze(1), sin[positions].to(dtype).unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, H, hd]; cos/sin: [T, 1, hd] ("rotate half" layout)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # caches: [S, Hkv, hd] (S = num_blocks * block_size); k, v: [T, Hkv, hd]
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                     scale: float) -> torch.Tensor:
    # q: [D, H, hd] -> [D, H, hd]; keys gathered through block tables
    if q.dtype != torch.float32:
        return _decode_grouped(q, k_cache, v_cache, meta, scale)
    keys = gather_blocks(k_cache, meta.decode_block_tables, meta.block_size).transpose(1, 2)  # [D, Hkv, Lmax, hd]
    values = gather_blocks(v_cache, meta.decode_block_tables, meta.block_size).transpose(1, 2)
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
    keys = gather_blocks(k_cache, meta.decode_block_tables, meta.block_size)  # [D, Lmax, Hkv, hd]
    values = gather_blocks(v_cache, meta.decode_block_tables, meta.block_size)
    if d == 1:
        q, keys, values = q.float(), keys.float(), values.float()
    hkv = keys.shape[2]
    scores = torch.matmul(q.view(d, hkv, h // hkv, hd), keys.permute(0, 2, 3, 1)).float() * scale  # [D, Hkv, g, L]
    scores.masked_fill_(~meta.decode_mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, values.transpose(1, 2)).reshape(d, h, hd)  # [D, Hkv, g, hd] -> [D, H, hd]
    return out.to(dtype)


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor, block_size: int) -> torch.Tensor:
    # cache: [S, Hkv, hd] with S = num_blocks * bs; tables: [D, W] -> [D, W * bs, Hkv, hd].
    # Copying whole blocks (one contiguous row each) is ~2x faster than gathering slot by slot.
    d, w = tables.shape
    _, hkv, hd = cache.shape
    blocks = cache.view(-1, block_size * hkv * hd)  # [num_blocks, bs * Hkv * hd]
    return torch.index_select(blocks, 0, tables.flatten()).view(d, w * block_size, hkv, hd)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, seq: PrefillSeq, scale: float) -> torch.Tensor:
    # q: [T, H, hd]; k, v: [T, Hkv, hd] (the step's own) -> [L, H, hd] for rows [q_start, q_end)
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
