"""CUDA graphs of the model's decode step, one per padded batch size, replayed for decode-only steps.

A graph reads its inputs from static buffers: token ids, positions, slots (-1 for padding rows:
no K/V write), block tables and context lengths (0 for padding rows: no attention). Decode
attention's grid is fixed by the longest context allowed; the kernel cuts each row's context by
that row's own length (decode_attention.split_parts).
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from forge_service.backends.cuda.metadata import CudaAttentionMetadata

log = logging.getLogger("forge.cuda.graphs")

Forward = Callable[[torch.Tensor, torch.Tensor, CudaAttentionMetadata, torch.Tensor], torch.Tensor]


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 to 64, every 16 to 256, every 32 beyond; always max_batch."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16)) + list(range(288, max_batch + 1, 32))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor  # [B, V], written by each replay


class DecodeGraphs:
    """Static input buffers and one captured forward per padded batch size."""

    def __init__(self, forward: Forward, device: torch.device, block_size: int, max_batch: int,
                 max_len: int) -> None:
        self.forward = forward
        self.block_size = block_size
        width = -(-max_len // block_size)
        self.max_len = width * block_size
        self.input_ids = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.int64, device=device)
        self.slots = torch.full((max_batch,), -1, dtype=torch.int64, device=device)
        self.tables = torch.zeros(max_batch, width, dtype=torch.int32, device=device)
        self.lens = torch.zeros(max_batch, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_batch, device=device)
        self.graphs: dict[int, _Graph] = {}

    def capture(self, sizes: list[int]) -> float:
        """Capture every size (largest first, so smaller graphs reuse its memory); returns seconds."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        # Python's cyclic collector must not run during a capture: collecting an engine that went
        # out of use destroys its graphs, an operation a capturing stream refuses, and the capture
        # fails (seen with a second engine built in one process). Collect now, then hold it off.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            for b in sorted(sizes, reverse=True):
                meta = self._meta(b)
                self.forward(self.input_ids[:b], self.positions[:b], meta, self.rows[:b])  # warm-up: compiles, tunes
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self.forward(self.input_ids[:b], self.positions[:b], meta, self.rows[:b])
                self.graphs[b] = _Graph(graph, logits)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        log.info("captured %d decode graphs (batch %s) in %.1f s", len(sizes), sizes, seconds)
        return seconds

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: CudaAttentionMetadata) -> torch.Tensor | None:
        """Logits [D, V] of a decode-only step from the smallest graph that fits; None when none does."""
        d = meta.num_decode_tokens
        if d != input_ids.shape[0] or meta.prefill is not None or meta.torch_prefills:
            return None
        b = next((s for s in sorted(self.graphs) if s >= d), None)
        width = meta.decode_tables.shape[1] if d else 0
        if b is None or width > self.tables.shape[1]:
            return None
        self.input_ids[:d].copy_(input_ids)
        self.positions[:d].copy_(positions)
        self.slots[:d].copy_(meta.slot_mapping)
        self.slots[d:b].fill_(-1)
        self.tables[:d, :width].copy_(meta.decode_tables)  # entries past a row's length are never read
        self.lens[:d].copy_(meta.decode_lens)
        self.lens[d:b].fill_(0)
        entry = self.graphs[b]
        entry.graph.replay()
        return entry.logits[:d]

    def _meta(self, b: int) -> CudaAttentionMetadata:
        return CudaAttentionMetadata(
            slot_mapping=self.slots[:b], block_size=self.block_size, num_decode_tokens=b,
            decode_tables=self.tables[:b], decode_lens=self.lens[:b],
            decode_max_len=self.max_len)
