"""One step's attention inputs on the GPU, built once per step from the runner's AttentionMetadata."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from forge_service.backends.base import AttentionMetadata, PrefillSeq
from forge_service.backends.cuda.prefill_attention import PrefillBatch, build_tiles


@dataclass
class CudaAttentionMetadata:
    """Device tensors the kernels read; the same object serves every layer of the step."""

    slot_mapping: torch.Tensor  # [T] int64; negative = no write (padding rows of a graph)
    block_size: int
    num_decode_tokens: int  # rows [0, D) are decodes
    decode_tables: torch.Tensor | None = None  # [D, W] int32
    decode_lens: torch.Tensor | None = None  # [D] int32 context length (0 for padding rows)
    decode_max_len: int = 0  # no decode row's context is longer (the tables' width in positions)
    prefill: PrefillBatch | None = None  # 16-bit dtypes: chunks for the prefill kernel
    # float32: chunks attended with torch SDPA (the CPU reference's code, on the GPU).
    torch_prefills: list[PrefillSeq] = field(default_factory=list)


@dataclass(frozen=True)
class ModelShape:
    """What the metadata needs to know of the model and the GPU."""

    num_kv_heads: int
    group: int  # query heads per KV head
    dtype: torch.dtype


def prepare(meta: AttentionMetadata, shape: ModelShape, device: torch.device) -> CudaAttentionMetadata:
    """Move one step's metadata to the GPU in the kernels' form. Block tables of prefill chunks
    are read off their slots: a block's first position sits at offset 0 of that block."""
    out = CudaAttentionMetadata(slot_mapping=_to(meta.slot_mapping, device, torch.int64),
                                block_size=meta.block_size, num_decode_tokens=meta.num_decode_tokens)
    d = meta.num_decode_tokens
    if d:
        tables = meta.decode_block_tables
        out.decode_tables = _to(tables, device, torch.int32)
        out.decode_lens = _to(meta.decode_lens, device, torch.int32)
        out.decode_max_len = tables.shape[1] * meta.block_size
    if not meta.prefills:
        return out
    if shape.dtype == torch.float32:
        out.torch_prefills = [_prefill_on(seq, device) for seq in meta.prefills]
    else:
        out.prefill = _prefill_batch(meta, shape.group, device)
    return out


def _prefill_batch(meta: AttentionMetadata, group: int, device: torch.device) -> PrefillBatch:
    bs = meta.block_size
    starts, lens, ctxs, tables = [], [], [], []
    for seq in meta.prefills:
        q_len = seq.q_end - seq.q_start
        slots = meta.slot_mapping[seq.q_start:seq.q_end] if seq.ctx_slots is None else seq.ctx_slots
        starts.append(seq.q_start)
        lens.append(q_len)
        ctxs.append(len(slots))
        tables.append((slots[::bs] // bs).tolist())
    width = max(len(t) for t in tables)
    padded = [t + [0] * (width - len(t)) for t in tables]
    ints = lambda values: torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)  # noqa: E731
    return PrefillBatch(q_start=ints(starts), q_len=ints(lens), ctx_len=ints(ctxs), block_tables=ints(padded),
                        tiles=ints(build_tiles(lens, group)).view(-1, 2))


def _prefill_on(seq: PrefillSeq, device: torch.device) -> PrefillSeq:
    moved = PrefillSeq(seq.q_start, seq.q_end)
    if seq.ctx_slots is not None:
        moved.ctx_slots = seq.ctx_slots.to(device, non_blocking=True)
        moved.mask = seq.mask.to(device, non_blocking=True)
    return moved


def _to(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).contiguous().to(device, non_blocking=True)
