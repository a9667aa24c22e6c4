"""SchedulerOutput -> flat batch tensors -> model -> sampler. Tensors begin here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from forge_service.backends.base import AttentionMetadata, PrefillSeq
from forge_service.config import CacheConfig
from forge_service.engine.outputs import ScheduledChunk, SchedulerOutput
from forge_service.models.arch import ArchConfig
from forge_service.sampling import RowSampling, Sampler, SamplingMetadata
from forge_service.structured import MatcherSet


@dataclass
class SampledToken:
    """The token sampled for one request this step, with the logprobs it asked for."""

    request_id: str
    token_id: int
    logprob: float | None = None
    rank: int | None = None
    top: list[tuple[int, float]] | None = None  # (token id, logprob), best first
    refused: bool = False  # its grammar refused the token (a bug: the mask allowed it); the request ends


def kv_block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    """Owns the K/V tensors, the per-request seeded generators and the sampler."""

    def __init__(self, model, arch: ArchConfig, cache: CacheConfig, dtype: torch.dtype) -> None:
        self.model = model
        self.arch = arch
        self.dtype = dtype
        self.backend = model.backend
        self.device = self.backend.device
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks or max(1, cache.kv_cache_bytes // kv_block_bytes(arch, cache.block_size, dtype))
        slots = self.num_blocks * self.block_size
        self.kv_caches = [
            (torch.zeros(slots, arch.num_kv_heads, arch.head_dim, dtype=dtype, device=self.device),
             torch.zeros(slots, arch.num_kv_heads, arch.head_dim, dtype=dtype, device=self.device))
            for _ in range(arch.num_layers)
        ]
        self.sampler: Sampler = self.backend.sampler()
        self.generators: dict[str, torch.Generator] = {}
        self.grammars: MatcherSet | None = None  # structured output's matchers; set by the engine

    def startup(self, max_batch: int, max_len: int) -> None:
        """Backend preparation once the KV cache exists (the CUDA backend captures decode graphs
        for up to max_batch rows and contexts of max_len)."""
        self.backend.startup(self.forward, self.arch, self.dtype, self.block_size, max_batch, max_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, logit_rows: torch.Tensor) -> torch.Tensor:
        """The model over this runner's KV cache: logits [N, V] float32 of `logit_rows`."""
        return self.model.forward(input_ids, positions, self.kv_caches, meta, logit_rows)

    def release(self, request_id: str) -> None:
        self.generators.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.release(request_id)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SampledToken]:
        """Run one step; returns a token for each chunk that samples, in chunk order."""
        decodes = [c for c in out.chunks if c.num_tokens == 1]
        prefills = [c for c in out.chunks if c.num_tokens > 1]
        ordered = decodes + prefills  # decodes first: they are attended as one padded batch
        input_ids, positions, slots, logit_rows, tables = self._flat_inputs(ordered)
        meta = AttentionMetadata(slot_mapping=slots, block_size=self.block_size, num_decode_tokens=len(decodes))
        if decodes:
            meta.decode_block_tables, meta.decode_mask, meta.decode_lens = self._decode_tables(
                decodes, tables[:len(decodes)])
        meta.prefills = self._prefill_seqs(prefills, len(decodes))
        meta = self.backend.prepare(meta)  # the backend's form, on its device, once per step
        input_ids, positions = input_ids.to(self.device), positions.to(self.device)
        sampling = [c for c in ordered if c.samples]
        rows = torch.tensor(logit_rows or [0], device=self.device)
        logits = self.backend.run(self.forward, input_ids, positions, meta, rows)
        if not sampling:
            return []
        sampled = self._sample(logits, sampling)
        by_id = {s.request_id: s for s in sampled}
        return [by_id[c.request.request_id] for c in out.chunks if c.samples]

    def _flat_inputs(self, chunks: list[ScheduledChunk]):
        ids: list[int] = []
        pos: list[int] = []
        logit_rows: list[int] = []
        for c in chunks:
            ids.extend(c.request.token_ids_slice(c.start, c.end))
            pos.extend(range(c.start, c.end))
            if c.samples:
                logit_rows.append(len(ids) - 1)
        positions = torch.tensor(pos)
        tables = self._block_tables(chunks)
        # slot of each new token: block_table[row, pos // bs] * bs + pos % bs
        rows = torch.repeat_interleave(torch.arange(len(chunks)), torch.tensor([c.num_tokens for c in chunks]))
        slots = tables[rows, positions // self.block_size] * self.block_size + positions % self.block_size
        return torch.tensor(ids), positions, slots, logit_rows, tables

    @staticmethod
    def _block_tables(chunks: list[ScheduledChunk]) -> torch.Tensor:
        width = max(len(c.block_ids) for c in chunks)
        return torch.tensor([c.block_ids + [0] * (width - len(c.block_ids)) for c in chunks])  # [B, W]

    def _context_slots(self, tables: torch.Tensor, length: int) -> torch.Tensor:
        # tables: [B, W] -> [B, length] flat cache slots of positions 0..length-1
        p = torch.arange(length)
        return tables[:, p // self.block_size] * self.block_size + p % self.block_size

    def _decode_tables(self, decodes: list[ScheduledChunk],
                       tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # tables: the decode rows of the step's block tables (padded with 0). Keep only the blocks
        # that hold context: a table may already own a block for the next token.
        width = max(-(-c.end // self.block_size) for c in decodes)
        tables = tables[:, :width].contiguous()  # [D, W], as every layer's attention reads it
        lens = torch.tensor([c.end for c in decodes], dtype=torch.int32)
        mask = torch.arange(width * self.block_size).unsqueeze(0) < lens.unsqueeze(1)  # [D, Lmax]
        return tables, mask[:, None, None, :], lens

    def _prefill_seqs(self, prefills: list[ScheduledChunk], offset: int) -> list[PrefillSeq]:
        seqs = []
        for c in prefills:
            seq = PrefillSeq(q_start=offset, q_end=offset + c.num_tokens)
            if c.start > 0:
                seq.ctx_slots = self._context_slots(torch.tensor([c.block_ids]), c.end)[0]
                q_pos = torch.arange(c.start, c.end).unsqueeze(1)
                seq.mask = torch.arange(c.end).unsqueeze(0) <= q_pos  # [q_len, ctx_len]
            seqs.append(seq)
            offset += c.num_tokens
        return seqs

    def _generator(self, chunk: ScheduledChunk) -> torch.Generator | None:
        req = chunk.request
        if req.seed is None:
            return None
        if req.request_id not in self.generators:
            self.generators[req.request_id] = torch.Generator().manual_seed(req.seed)
        return self.generators[req.request_id]

    def _checkpoint(self, chunks: list[ScheduledChunk]) -> Callable[[], None]:
        """Save what sampling advances per request (seeded generators, grammar matchers); the
        returned function restores it, so that a step that fails leaves every request as it was."""
        generators = [(g, g.get_state()) for c in chunks if (g := self._generator(c)) is not None]
        matchers = [] if self.grammars is None else [
            (m, m.num_tokens) for c in chunks if (m := self.grammars.get(c.request.request_id)) is not None]

        def restore() -> None:
            for generator, state in generators:
                generator.set_state(state)
            for matcher, num_tokens in matchers:
                matcher.rollback(matcher.num_tokens - num_tokens)
        return restore

    def _sample(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[SampledToken]:
        restore = self._checkpoint(chunks)
        try:
            return self._sample_rows(logits, chunks)
        except BaseException:
            restore()
            raise

    def _sample_rows(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[SampledToken]:
        rows = [RowSampling(params=c.request.sampling_params, prompt_token_ids=c.request.prompt_token_ids,
                            output_token_ids=c.request.output_token_ids, generator=self._generator(c),
                            seed=c.request.seed)
                for c in chunks]
        meta = SamplingMetadata.build(rows, logits.shape[-1], logits.device)
        request_ids = [c.request.request_id for c in chunks]
        if self.grammars is not None:
            meta.token_bitmask = self.grammars.bitmask(request_ids)  # None when no row is constrained
        res = self.sampler(logits, meta)
        token_ids = res.token_ids.tolist()
        refused = self.grammars.accept(request_ids, token_ids) if meta.token_bitmask is not None else ()
        results = []
        for i, c in enumerate(chunks):
            s = SampledToken(c.request.request_id, token_ids[i], refused=request_ids[i] in refused)
            k = c.request.sampling_params.logprobs
            if k is not None and res.logprobs is not None:
                s.logprob = float(res.logprobs[i])
                s.rank = int(res.ranks[i]) if res.ranks is not None else None
                if k and res.top_ids is not None:
                    s.top = list(zip(res.top_ids[i, :k].tolist(), res.top_logprobs[i, :k].tolist()))
                else:
                    s.top = []
            results.append(s)
        return results
