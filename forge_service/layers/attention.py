"""Paged attention metadata and the layer that dispatches to a backend."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class PrefillSeq:
    """A chunk of q_len > 1 tokens of one sequence, at rows [q_start, q_end) of the flat batch."""

    q_start: int
    q_end: int
    # Gather indices of the whole context (cached + this chunk) in the flat cache; None when the
    # chunk starts at position 0, so its own K/V are the whole context.
    ctx_slots: torch.Tensor | None = None
    # [q_len, ctx_len] bool, True = attend; None with ctx_slots None (plain causal).
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Built once per step by the model runner, shared by every layer."""

    slot_mapping: torch.Tensor  # [T] long: flat cache slot of each new token
    block_size: int
    num_decode_tokens: int  # rows [0, D) have q_len 1 and are attended in one padded batch
    # [D, W] block tables of the decode rows (padded with block 0); keys are gathered a whole
    # block at a time, Lmax = W * block_size.
    decode_block_tables: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, Lmax] bool, True = attend
    decode_lens: torch.Tensor | None = None  # [D] int32 context lengths, the mask's own
    prefills: list[PrefillSeq] = field(default_factory=list)
