"""SchedulerOutput -> flat batch tensors -> model -> sampler. Tensors begin here."""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Callable

import torch

from forge_service.backends.base import AttentionMetadata, PrefillSeq
from forge_service.config import CacheConfig
from forge_service.engine.outputs import ScheduledChunk, SchedulerOutput
from forge_service.engine.request import PromptLogprob, Request
from forge_service.models.arch import ArchConfig
from forge_service.sampling import RowSampling, Sampler, SamplingMetadata
from forge_service.sampling.bad_words import banned_tokens
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
    embedding: list[float] | None = None  # SamplingParams.embed: the final hidden state of the row sampled from


def kv_block_bytes(arch: ArchConfig, block_size: int, dtype: torch.dtype) -> int:
    return 2 * arch.num_layers * block_size * arch.num_kv_heads * arch.head_dim * torch.finfo(dtype).bits // 8


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. On the CPU it lives in anonymous memory, which the OS maps to
    zero pages and commits only where written: a large cache takes memory as it fills, not at
    start-up, and any slot never written reads as zeros (finite, so masked padding cannot turn an
    attention sum into NaN)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    memory = mmap.mmap(-1, max(1, count * torch.finfo(dtype).bits // 8))
    return torch.frombuffer(memory, dtype=dtype, count=count).view(shape)  # keeps `memory` alive


def _is_decode(chunk: ScheduledChunk) -> bool:
    """A decode row computes the token after a sampled one (and its draft). A prompt's tokens always
    take the prefill path, also its last one alone (after a prefix-cache hit or a chunk boundary):
    each prompt position then goes through the same kernels however the prompt was cached or split,
    which keeps greedy output the same where decode and prefill attention round differently (the
    CUDA backend's do; the CPU backend's give the same bits)."""
    return chunk.num_tokens == 1 + len(chunk.draft) and chunk.start >= chunk.request.num_prompt_tokens


class ModelRunner:
    """Owns the K/V tensors and the sampler."""

    def __init__(self, model, arch: ArchConfig, cache: CacheConfig, dtype: torch.dtype) -> None:
        self.model = model
        self.arch = arch
        self.dtype = dtype
        self.backend = model.backend
        self.device = self.backend.device
        self.block_size = cache.block_size
        self.num_blocks = cache.num_blocks or max(1, cache.kv_cache_bytes // kv_block_bytes(arch, cache.block_size, dtype))
        slots = self.num_blocks * self.block_size
        shape = (slots, arch.num_kv_heads, arch.head_dim)
        self.kv_caches = [(_zeros(shape, dtype, self.device), _zeros(shape, dtype, self.device))
                          for _ in range(arch.num_layers)]
        self.sampler: Sampler = self.backend.sampler()
        self.grammars: MatcherSet | None = None  # structured output's matchers; set by the engine

    def startup(self, max_batch: int, max_len: int) -> None:
        """Backend preparation once the KV cache exists (the CUDA backend captures decode graphs
        for up to max_batch rows and contexts of max_len)."""
        self.backend.startup(self.forward, self.arch, self.dtype, self.block_size, max_batch, max_len)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta, logit_rows: torch.Tensor) -> torch.Tensor:
        """The model over this runner's KV cache: logits [N, V] float32 of `logit_rows`."""
        return self.model.forward(input_ids, positions, self.kv_caches, meta, logit_rows)

    def release(self, request_id: str) -> None:
        if self.grammars is not None:
            self.grammars.release(request_id)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, on_launch: Callable[[], None] | None = None) -> list[SampledToken]:
        """Run one step; returns a token for each chunk that samples, in chunk order. A chunk with a
        draft gets its accepted draft tokens first, then the one the model chose after them.
        `on_launch` is called once the inputs are built, just before the model runs."""
        if self.grammars is not None:
            self._cut_drafts(out.chunks)
        for c in out.chunks:
            if c.kv_copy is not None:
                self._copy_kv(*c.kv_copy)
        # A decode with a draft is one decode row per verified token: row i attends to the context
        # and the draft before it, whose KV this step writes before any row attends. Verification
        # thus runs the kernels a plain decode runs (the fused decode call included), and each
        # row's logits are those a plain decode at its position would get.
        decodes, prefills = [], []
        for chunk in out.chunks:
            (decodes if _is_decode(chunk) else prefills).append(chunk)
        ordered = decodes + prefills  # decodes first: they are attended as one padded batch
        input_ids, positions, slots, logit_rows = self._flat_inputs(ordered)
        num_decode_rows = sum(c.num_tokens for c in decodes)
        meta = AttentionMetadata(slot_mapping=slots, block_size=self.block_size, num_decode_tokens=num_decode_rows)
        if decodes:
            meta.decode_block_tables, meta.decode_mask, meta.decode_lens = self._decode_tables(decodes)
        meta.prefills = self._prefill_seqs(prefills, num_decode_rows)
        meta.lora = _adapter_rows(ordered)
        meta = self.backend.prepare(meta)  # the backend's form, on its device, once per step
        input_ids, positions = input_ids.to(self.device), positions.to(self.device)
        sampling = [c for c in ordered if c.samples]
        scored = _prompt_rows(ordered)  # after the sampled rows: logits for prompt logprobs
        rows = torch.tensor(logit_rows + [row for _, _, row in scored] or [0], device=self.device)
        if on_launch is not None:
            on_launch()
        logits = self.backend.run(self.forward, input_ids, positions, meta, rows)
        if scored:
            self._score_prompt(logits[len(logit_rows):], scored)
        if not sampling:
            return []
        sampled = self._sample(logits[:len(logit_rows)], sampling)
        self._embed(sampling, sampled)
        by_id: dict[str, list[SampledToken]] = {}
        for s in sampled:
            by_id.setdefault(s.request_id, []).append(s)
        return [s for c in out.chunks if c.samples for s in by_id[c.request.request_id]]

    def _embed(self, chunks: list[ScheduledChunk], sampled: list[SampledToken]) -> None:
        """Give each embedding request's token its row's final hidden state (the model's, of the
        step's logit rows: 1 + its draft per sampling chunk, in order)."""
        rows, row = {}, 0
        for c in chunks:
            if c.request.sampling_params.embed:
                rows[c.request.request_id] = row
            row += 1 + len(c.draft)
        if not rows:
            return
        hidden = self.model.last_hidden
        for s in sampled:
            if s.request_id in rows:
                s.embedding = hidden[rows[s.request_id]].float().cpu().tolist()

    def _score_prompt(self, logits: torch.Tensor, scored: list[tuple[Request, int, int]]) -> None:
        """Each scored row's logprobs of the prompt token after it, kept on its request by position
        (so a chunk computed again after a failed step or a preemption overwrites, never adds)."""
        targets = torch.tensor([r.prompt_token_ids[p + 1] for r, p, _ in scored], device=logits.device)
        k = max(r.sampling_params.prompt_logprobs for r, _, _ in scored)
        res = self.sampler.score(logits, targets, k)
        logprobs, ranks = res.logprobs.tolist(), res.ranks.tolist()
        top_ids, top_logprobs = res.top_ids.tolist(), res.top_logprobs.tolist()
        for i, (request, position, _) in enumerate(scored):
            want = request.sampling_params.prompt_logprobs
            top = list(zip(top_ids[i][:want], top_logprobs[i][:want]))
            request.prompt_logprobs[position + 1] = PromptLogprob(
                request.prompt_token_ids[position + 1], logprobs[i], ranks[i], top)

    def _copy_kv(self, source: int, block: int, tokens: int) -> None:
        """The first `tokens` slots of a cached block into a request's own block, every layer."""
        src, dst = source * self.block_size, block * self.block_size
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst:dst + tokens] = k_cache[src:src + tokens]
            v_cache[dst:dst + tokens] = v_cache[src:src + tokens]

    def _flat_inputs(self, chunks: list[ScheduledChunk]):
        """The step's token ids, positions and cache slots (each token's: its block's first slot plus
        its offset in the block), and its sampled rows. Python lists, then one tensor each: at one
        stream, torch's small-tensor ops took 0.22 ms of a 6 ms step here."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        bs = self.block_size
        for c in chunks:
            d = len(c.draft)
            ids.extend(c.request.token_ids_slice(c.start, c.end - d))
            ids.extend(c.draft)
            pos.extend(range(c.start, c.end))
            blocks = c.block_ids
            slots.extend([blocks[p // bs] * bs + p % bs for p in range(c.start, c.end)])
            if c.samples:  # the last known token's row, then one per draft token
                logit_rows.extend(range(len(ids) - 1 - d, len(ids)))
        return torch.tensor(ids), torch.tensor(pos), torch.tensor(slots), logit_rows

    def _context_slots(self, tables: torch.Tensor, length: int) -> torch.Tensor:
        # tables: [B, W] -> [B, length] flat cache slots of positions 0..length-1
        p = torch.arange(length)
        return tables[:, p // self.block_size] * self.block_size + p % self.block_size

    def _decode_tables(self, decodes: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The decode rows' block tables [D, W] (padded with 0), attention masks and context lengths:
        a row per token, so a verified draft's rows each take its chunk's table. A table keeps only
        the blocks that hold context (it may already own a block for the next token)."""
        width = max(-(-c.end // self.block_size) for c in decodes)
        tables: list[list[int]] = []
        lens: list[int] = []
        for c in decodes:
            table = c.block_ids[:width]
            table = table + [0] * (width - len(table))
            for n in range(c.start + 1, c.end + 1):
                tables.append(table)
                lens.append(n)
        context = torch.tensor(lens, dtype=torch.int32)
        mask = torch.arange(width * self.block_size).unsqueeze(0) < context.unsqueeze(1)  # [D, Lmax]
        return torch.tensor(tables), mask[:, None, None, :], context

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

    def _cut_drafts(self, chunks: list[ScheduledChunk]) -> None:
        """Cut each constrained request's draft at its first token the grammar forbids, so that
        every verified position has a mask (the cut tokens' slots stay allocated until the
        scheduler trims them)."""
        for c in chunks:
            if not c.draft or (m := self.grammars.get(c.request.request_id)) is None:
                continue
            allowed = m.accept_prefix(c.draft)
            m.rollback(allowed)
            if allowed < len(c.draft):
                c.num_tokens -= len(c.draft) - allowed
                c.draft = c.draft[:allowed]

    def _checkpoint(self, chunks: list[ScheduledChunk]) -> Callable[[], None]:
        """Save what sampling advances per request (grammar matchers); the returned function
        restores it, so that a step that fails leaves every request as it was. Seeded noise is
        keyed by (seed, position), so it has no state to save."""
        matchers = [] if self.grammars is None else [
            (m, m.num_tokens) for c in chunks if (m := self.grammars.get(c.request.request_id)) is not None]

        def restore() -> None:
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
        """Sample every verified position, then keep each chunk's run: its draft tokens up to the
        first one that differs from the token sampled at its position, and that sampled token.

        Each position is sampled from the target's own distribution there (penalties and grammar
        see the draft before it), so a draft token d is kept with probability p(d), and a rejected
        position's token is distributed as p without d, renormalised: rejection sampling against
        a point-mass draft, exactly. Greedy rows keep the longest prefix equal to the argmax."""
        rows: list[RowSampling] = []
        request_ids: list[str] = []
        ahead: list[list[int]] = []  # the draft tokens before each row's position
        for c in chunks:
            req = c.request
            for j in range(len(c.draft) + 1):
                output = req.output_token_ids + c.draft[:j] if j else req.output_token_ids
                rows.append(RowSampling(params=req.sampling_params, prompt_token_ids=req.prompt_token_ids,
                                        output_token_ids=output, generator=_position_generator(
                                            None if req.sampling_params.greedy else req.seed, len(output)),
                                        seed=req.seed, banned=_banned(req, output),
                                        allowed=req.allowed_token_index))
                request_ids.append(req.request_id)
                ahead.append(c.draft[:j])
        meta = SamplingMetadata.build(rows, logits.shape[-1], logits.device)
        if self.grammars is not None:
            meta.token_bitmask = self.grammars.bitmask(request_ids, ahead)  # None when no row is constrained
        res = self.sampler(logits, meta)
        token_ids = res.token_ids.tolist()
        results = []
        row = 0
        for c in chunks:
            kept = _through_stop(accepted_run(c.draft, token_ids[row:row + len(c.draft) + 1]), c.request.stop_token_set)
            refused = False
            if meta.token_bitmask is not None:  # the grammar takes the kept tokens, up to one it refuses
                for n, token in enumerate(kept):
                    if self.grammars.accept([c.request.request_id], [token]):
                        kept, refused = kept[:n + 1], True
                        break
            for j, token in enumerate(kept):
                results.append(self._sampled_token(c, row + j, token, res, refused and j == len(kept) - 1))
            row += len(c.draft) + 1
        return results

    @staticmethod
    def _sampled_token(c: ScheduledChunk, i: int, token_id: int, res, refused: bool) -> SampledToken:
        s = SampledToken(c.request.request_id, token_id, refused=refused)
        k = c.request.sampling_params.logprobs
        if k is not None and res.logprobs is not None:
            s.logprob = float(res.logprobs[i])
            s.rank = int(res.ranks[i]) if res.ranks is not None else None
            if k and res.top_ids is not None:
                s.top = list(zip(res.top_ids[i, :k].tolist(), res.top_logprobs[i, :k].tolist()))
            else:
                s.top = []
        return s


def _banned(request: Request, output: list[int]) -> frozenset[int]:
    """Tokens the row after `output` may not sample: its stop tokens while the output is shorter
    than min_tokens, and the last token of each bad word the output would complete."""
    short = len(output) < request.sampling_params.min_tokens
    if not (short or request.bad_word_ids):
        return frozenset()
    return frozenset(banned_tokens(request.bad_word_ids, output)).union(request.stop_token_set if short else ())


def _adapter_rows(chunks: list[ScheduledChunk]) -> list[tuple[int, torch.Tensor]]:
    """(adapter, its flat rows) for each LoRA adapter that requests among `chunks` take, rows
    numbered across `chunks` in order (AttentionMetadata.lora)."""
    rows: dict[int, list[int]] = {}
    offset = 0
    for c in chunks:
        if c.request.adapter:
            rows.setdefault(c.request.adapter, []).extend(range(offset, offset + c.num_tokens))
        offset += c.num_tokens
    return [(adapter, torch.tensor(r, dtype=torch.int64)) for adapter, r in sorted(rows.items())]


def _prompt_rows(chunks: list[ScheduledChunk]) -> list[tuple[Request, int, int]]:
    """(request, position, flat row) of each row whose next token is a prompt token, for the
    requests that want prompt logprobs; rows are numbered across `chunks` in order."""
    rows: list[tuple[Request, int, int]] = []
    offset = 0
    for c in chunks:
        request = c.request
        if request.prompt_logprobs is not None:
            last = min(c.end, request.num_prompt_tokens - 1)  # the prompt's last token predicts output
            rows.extend((request, p, offset + p - c.start) for p in range(c.start, last))
        offset += c.num_tokens
    return rows


def accepted_run(draft: list[int], sampled: list[int]) -> list[int]:
    """The tokens a verified draft yields: `sampled[i]` is the token sampled at draft position i
    (len(draft) + 1 of them, the last after the whole draft). Keeps the draft while it agrees with
    the samples, then the first sample that differs (or the one after the whole draft)."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return sampled[:n + 1]


def _through_stop(tokens: list[int], stops: frozenset[int] | set[int]) -> list[int]:
    """`tokens` up to and with the first stop token: nothing after it is the request's (nor its
    grammar's, which ends at EOS)."""
    for n, token in enumerate(tokens):
        if token in stops:
            return tokens[:n + 1]
    return tokens


_MASK64 = (1 << 64) - 1


def _position_generator(seed: int | None, position: int) -> torch.Generator | None:
    """The noise source of a seeded request's token at output `position`: a function of the two
    alone, so a seeded request gets the same tokens however its positions are batched, verified
    or recomputed (splitmix64 of the pair)."""
    if seed is None:
        return None
    z = (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return torch.Generator().manual_seed(z ^ (z >> 31))
