"""Continuous batching with chunked prefill and recompute preemption. Plain Python, no torch."""
from __future__ import annotations

import bisect
import itertools
from collections import deque

from forge_service.config import SchedulerConfig, SpeculativeConfig
from forge_service.engine.outputs import ScheduledChunk, SchedulerOutput
from forge_service.engine.request import Request, RequestStatus
from forge_service.errors import CONTEXT_LENGTH_EXCEEDED, InvalidArgument
from forge_service.kv_cache.manager import KVCacheManager
from forge_service.speculative.proposer import NgramProposer
from forge_service.speculative.step_cost import StepCost


# Weight of the latest step in the measured cost of a token: about the last 4 steps that prefilled.
TOKEN_MS_WEIGHT = 0.25


class Scheduler:
    """Decides, each step, which tokens of which requests the model computes.

    There are no prefill and decode phases: each request's `num_computed_tokens` catches up
    with its `num_tokens` (prompt + output) under a token budget. Running requests go first,
    oldest first, then waiting ones in FIFO order. When KV blocks run out, the newest running
    request is preempted: its blocks are freed and it is re-queued at the front of the waiting
    queue, to be recomputed later over its prompt and the tokens it already generated.

    Invariant: `running + waiting` is in arrival order (of `add`). Preemption moves the newest
    running request to the front of the waiting queue and admission moves the oldest waiting one
    to the back of `running`, so a re-admitted request keeps its seniority. Only running requests
    hold blocks, so the oldest one always makes progress.

    Under the "priority" policy, order is by (priority, arrival) instead of arrival alone, with
    the same invariant: a request that outranks some running ones joins `running` among them, and
    preemption takes the lowest-ranked. Besides, a waiting request that outranks the last running
    one and finds no seat or too few free blocks for its first chunk has that one preempted, and
    more as needed, before the step is scheduled.
    """

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 speculative: SpeculativeConfig | None = None, max_decode_rows: int | None = None,
                 row_block: int = 1) -> None:
        self.config = config
        self.kv = kv
        self.speculative = speculative or SpeculativeConfig(speculative="off")  # none given: no drafting
        # The most rows the backend runs a decode step on with its fast kernels (None: no bound);
        # drafts never take a step past it.
        self.max_decode_rows = max_decode_rows
        # The backend's kernels take a decode step's rows in blocks of this many: drafts fill the
        # rows the step's decodes leave free in their last block and never open another one.
        self.row_block = row_block
        # Drafts for decodes (speculative decoding), None when it is off.
        self.proposer = NgramProposer(self.speculative) if self.speculative.enabled else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        # Milliseconds a scheduled token costs, measured on the steps that prefill (None: none yet).
        self.token_ms: float | None = None
        # Decode steps' times by their rows, for drafting's cost model, where the configuration
        # does not fix its base (spec_step_base_rows 0).
        self.step_cost = StepCost() if self.proposer is not None and not self.speculative.spec_step_base_rows else None

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens fit in the whole KV cache (check prompts at admission)."""
        return self.kv.blocks_needed(num_tokens) <= self.kv.num_blocks

    def add(self, request: Request) -> None:
        """Queue a request at the back. Raises InvalidArgument if its id is taken or its tokens could never fit."""
        if request.request_id in self._requests:
            raise InvalidArgument(f"request id {request.request_id!r} is already queued or running")
        if request.num_tokens == 0:
            raise InvalidArgument("the prompt is empty")
        if not self.can_ever_fit(request.num_tokens):
            raise InvalidArgument(
                f"the prompt needs {request.num_tokens} tokens of KV cache; it holds "
                f"{self.kv.num_blocks * self.kv.block_size}", kind=CONTEXT_LENGTH_EXCEEDED)
        request.status = RequestStatus.WAITING
        request.queue_key = (request.sampling_params.priority, next(self._arrivals))
        self._requests[request.request_id] = request
        _insert(self.waiting, request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.scheduling_policy == "priority":
            self._give_way(out)
        given_way = len(out.preempted)
        # Running requests with one token left to compute: this step's plain decodes.
        decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        budget, prefill_room = self._schedule_running(out, self.config.max_num_batched_tokens,
                                                      self._prefill_room(decodes), decodes)
        # After a preemption for blocks memory is tight: admitting now would only thrash.
        if len(out.preempted) == given_way:
            self._schedule_waiting(out, min(budget, prefill_room))
        return out

    def _give_way(self, out: SchedulerOutput) -> None:
        """Preempt the lowest-ranked running requests while the head of the queue outranks them
        and has no seat, or too few free blocks for its first chunk."""
        while self.waiting and self.running and self.running[-1].queue_key > self.waiting[0].queue_key:
            head = self.waiting[0]
            first_chunk = min(head.num_tokens, self.config.max_num_batched_tokens)
            if len(self.running) < self.config.max_num_seqs and \
                    self.kv.num_free_blocks >= self.kv.blocks_needed(first_chunk):
                return
            self._preempt(self.running.pop(), out)

    def _prefill_room(self, decodes: int) -> int:
        """How many prompt tokens this step may prefill. A step costs about its token count, and
        every decoding stream waits for it: while streams decode, prefill chunks get what is left
        after them of max_tokens_while_decoding, and of the tokens that max_step_ms_while_decoding
        holds at the measured cost of a token; at least a block's worth, so that new requests still
        start under a full batch of decodes."""
        if not decodes:
            return self.config.max_num_batched_tokens
        limits = [self.config.max_tokens_while_decoding] if self.config.max_tokens_while_decoding else []
        if self.config.max_step_ms_while_decoding and self.token_ms:
            limits.append(int(self.config.max_step_ms_while_decoding / self.token_ms))
        if not limits:
            return self.config.max_num_batched_tokens
        return max(self.kv.block_size, min(limits) - decodes)

    def observe(self, out: SchedulerOutput, seconds: float) -> None:
        """How long the step `out` scheduled took, start to end. A step that prefilled updates the
        cost of a token (an average over recent such steps), which bounds prefill chunks while
        streams decode. Its fixed part, spread over fewer tokens when chunks shrink, raises the
        cost a token is charged: the chunks settle where whole steps take the time allowed."""
        if not out.num_tokens:
            return
        if any(chunk.num_tokens - len(chunk.draft) > 1 for chunk in out.chunks):
            ms = 1000.0 * seconds / out.num_tokens
            self.token_ms = ms if self.token_ms is None else self.token_ms + TOKEN_MS_WEIGHT * (ms - self.token_ms)
        elif self.step_cost is not None:  # a decode step: its rows are its tokens, drafts included
            self.step_cost.observe(out.num_tokens, seconds)

    @property
    def step_base_rows(self) -> float:
        """A decode step's cost that does not grow with its rows, in rows' worth: the configured
        spec_step_base_rows, or where that is 0, as measured on this engine's decode steps; 0 where
        nothing drafts."""
        if self.proposer is None:
            return 0.0
        return self.step_cost.base_rows if self.step_cost is not None else self.speculative.spec_step_base_rows

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests; append sampled tokens. Returns requests that got a token."""
        return [c.request for c in out.chunks if self.advance(c, sampled.get(c.request.request_id))]

    def advance(self, chunk: ScheduledChunk, token_ids: int | list[int] | None) -> int:
        """Mark one chunk computed and append its sampled tokens (None when it does not sample):
        one, or for a chunk with a draft its accepted draft tokens and the token after them.
        Returns how many tokens the request got, fewer when one of them ended it (stop token,
        max_tokens: nothing past it is kept); 0 also when it finished (aborted, stop string,
        failed) since schedule()."""
        request = chunk.request
        if self._requests.get(request.request_id) is not request:
            return 0
        assert request.num_computed_tokens == chunk.start, (request.request_id, chunk.start)
        if chunk.kv_copy is not None:
            self.kv.copy_done(request.request_id)
        if not chunk.samples:
            request.num_computed_tokens += chunk.num_tokens
            self.kv.cache_computed(request.request_id, request.num_computed_tokens, request.token_ids_slice,
                                   request.cache_root)
            return 0
        assert token_ids is not None, f"no token sampled for {request.request_id}"
        tokens = [token_ids] if isinstance(token_ids, int) else token_ids
        drafted, accepted = len(chunk.draft), len(tokens) - 1
        assert 0 <= accepted <= drafted and tokens[:accepted] == chunk.draft[:accepted], (request.request_id, tokens)
        if drafted:
            request.num_drafted_tokens += drafted
            request.num_accepted_tokens += accepted
            if self.proposer is not None:
                self.proposer.update(request.request_id, drafted, accepted)
        appended = 0
        for token_id in tokens:
            request.output_token_ids.append(token_id)
            appended += 1
            if request.check_stop():
                break
        # The KV of the rejected draft tokens (and of any past a stop) is not computed: its slots
        # are written over later and blocks held only for them go back to the pool.
        request.num_computed_tokens = request.num_tokens - 1
        if drafted:
            self.kv.trim(request.request_id, request.num_computed_tokens)
        self.kv.cache_computed(request.request_id, request.num_computed_tokens, request.token_ids_slice,
                               request.cache_root)
        # The next step writes the last token's KV; if the cache cannot hold it, stop here.
        if not request.status.finished and not self.can_ever_fit(request.num_tokens):
            request.status = RequestStatus.FINISHED_LENGTH
        if request.status.finished:
            self._remove(request, self.running)
        return appended

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string): dequeue it, free its blocks. None if unknown."""
        assert status.finished, status
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._remove(request, self.running if request.status is RequestStatus.RUNNING else self.waiting)
        request.status = status
        return request

    def _schedule_running(self, out: SchedulerOutput, budget: int, prefill_room: int,
                          decodes: int) -> tuple[int, int]:
        """Schedule the running requests: decodes (with drafts), and prefill chunks of up to
        `prefill_room` tokens in all. Returns what is left of the budget and of that room."""
        i = 0
        drafts_left, worth = self._draft_room(decodes)
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if n > 1:
                n = min(n, prefill_room)
                prefill_room -= n
            if n > 0:
                block_ids = self._allocate_or_preempt(request, n, out)
                if block_ids is None:
                    break  # `request` was the newest and preempted itself
                draft = []
                if n == 1 and self.proposer is not None:
                    draft, block_ids = self._draft(request, min(budget - 1, drafts_left), worth, block_ids)
                    drafts_left -= len(draft)
                out.chunks.append(ScheduledChunk(request, request.num_computed_tokens, n + len(draft), block_ids, draft))
                budget -= n + len(draft)
            i += 1
        return budget, prefill_room

    def _draft_room(self, decodes: int) -> tuple[int, float]:
        """The most tokens this step may draft, and what a verified position must yield to pay for
        its row. With M decode rows a step costs about (base + M) rows' worth (base: the cost that
        does not grow with rows, step_base_rows), so a plain token costs (base + M) / M rows,
        and a drafted one, costing one row, pays when it is kept with probability M / (base + M):
        drafting is nearly free for one stream and worth it only on near-certain drafts for many.
        Where the backend takes rows in blocks (row_block), a row that opens a block costs that
        block's pass over the weights, not one row: drafts only fill the free rows of a step's one
        block. A step of more blocks is split between the threads by rows, where every row costs
        its own compute, about a decode's, so such steps draft nothing (at 12 decodes on the CPU,
        drafts filling a second block lost even at 99% accepted: bench/speculative.py --draft-steps)."""
        if self.proposer is None:
            return 0, 0.0
        room = self.speculative.spec_max_step_tokens
        if self.max_decode_rows is not None:
            room = min(room, max(0, self.max_decode_rows - decodes))
        if self.row_block > 1:
            room = min(room, max(0, self.row_block - decodes))
        return room, decodes / (self.step_base_rows + decodes) if decodes else 0.0

    def _draft(self, request: Request, limit: int, worth: float, block_ids: list[int]) -> tuple[list[int], list[int]]:
        """A draft to verify after the request's last token, with the blocks to hold it; no draft
        when the pool is short (drafts never preempt)."""
        # The token after an accepted draft comes on top: never draft past max_tokens.
        limit = min(limit, request.max_output_tokens - len(request.output_token_ids) - 1)
        draft = self.proposer.propose(request, limit, worth)
        if not draft:
            return [], block_ids
        extended = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + 1 + len(draft))
        if extended is None:
            return [], block_ids
        return draft, extended

    def _allocate_or_preempt(self, request: Request, n: int, out: SchedulerOutput) -> list[int] | None:
        """Blocks for n more tokens of `request`, preempting the newest running requests as needed."""
        while True:
            block_ids = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + n)
            if block_ids is not None:
                return block_ids
            victim = self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        _insert(self.waiting, request)  # at the front, unless priorities put others before it
        out.preempted.append(request)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            try:
                chunk = self._admit(request, budget)
            except Exception as error:  # something in this request's tokens: it fails alone, the queue goes on
                self._drop_head(request, error, out)
                continue
            if chunk is None:
                return  # FIFO: nobody overtakes the head of the queue
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            _insert(self.running, request)
            out.chunks.append(chunk)
            out.num_admitted += 1
            budget -= chunk.num_tokens

    def _admit(self, request: Request, budget: int) -> ScheduledChunk | None:
        """The first chunk of the head of the queue, after its prefix-cache hit; None if it does not fit now."""
        # A request that still wants its prompt's logprobs computes every prompt position: a
        # cached one would have no logits. Its blocks are cached for others all the same.
        cached = 0 if request.prompt_logprobs is not None else self.kv.match_prefix(
            request.request_id, request.all_token_ids, request.cache_root)
        request.num_computed_tokens = cached
        n = min(request.num_tokens - request.num_computed_tokens, budget)
        block_ids = self.kv.allocate_slots(request.request_id, request.num_computed_tokens + n)
        if block_ids is None:
            self.kv.free(request.request_id)  # give back the shared prefix until it can run
            request.num_computed_tokens = 0
            return None
        if request.num_preemptions == 0:
            request.num_cached_tokens = cached
        return ScheduledChunk(request, request.num_computed_tokens, n, block_ids,
                              kv_copy=self.kv.pending_copy(request.request_id))

    def _drop_head(self, request: Request, error: Exception, out: SchedulerOutput) -> None:
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        self._remove(request, self.waiting)
        request.status = RequestStatus.FINISHED_ERROR
        out.failed.append((request, error))

    def _remove(self, request: Request, queue: list[Request] | deque[Request]) -> None:
        del self._requests[request.request_id]
        # By identity: Request is a dataclass, so == would compare every field.
        index = next(i for i, r in enumerate(queue) if r is request)
        del queue[index]
        self.kv.free(request.request_id)
        if self.proposer is not None:
            self.proposer.release(request.request_id)


def _insert(queue: list[Request] | deque[Request], request: Request) -> None:
    """Put `request` into a queue kept in queue_key order: at either end in arrival order, where
    it belongs among others under priorities."""
    if not queue or queue[-1].queue_key <= request.queue_key:
        queue.append(request)
    elif isinstance(queue, deque) and queue[0].queue_key >= request.queue_key:
        queue.appendleft(request)
    else:
        queue.insert(bisect.bisect(queue, request.queue_key, key=lambda r: r.queue_key), request)
