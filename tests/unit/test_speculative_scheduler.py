"""The scheduler's side of speculative decoding: drafts for decodes, and what a verified run does
to the request and its KV blocks."""
from __future__ import annotations

import pytest

from forge_service.config import SchedulerConfig, SpeculativeConfig
from forge_service.engine.outputs import ScheduledChunk, SchedulerOutput
from forge_service.engine.request import Request, RequestStatus, SamplingParams
from forge_service.engine.scheduler import Scheduler
from forge_service.kv_cache.manager import KVCacheManager
from forge_service.speculative.step_cost import PRIOR_BASE_ROWS, REFIT_EVERY

PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6, 1, 2]  # the bigram (1, 2) was followed by 3, 4, 5, ...


def running(max_tokens: int = 30, stop=frozenset(), max_draft: int = 4, base_rows: float = 1e9,
            max_decode_rows: int | None = None, row_block: int = 1, streams: int = 1) -> tuple[Scheduler, Request]:
    """A scheduler whose requests (`streams` of them, the first returned) have been prefilled and
    sampled 3, so that each drafts next. By default a step's rows cost nothing beside its base, so
    drafts are as long as allowed."""
    spec = SpeculativeConfig(speculative="ngram", spec_max_draft=max_draft, spec_ngram_min=2, spec_ngram_max=3,
                             spec_step_base_rows=base_rows, spec_max_step_tokens=16)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=128), KVCacheManager(128, 4), spec, max_decode_rows,
                      row_block)
    requests = [Request(f"r{i}" if i else "r", list(PROMPT), SamplingParams(max_tokens=max_tokens),
                        stop_token_set=frozenset(stop)) for i in range(streams)]
    for request in requests:
        sched.add(request)
    out = sched.schedule()
    assert len(out.chunks) == streams
    for chunk in out.chunks:
        assert sched.advance(chunk, [3]) == 1
    return sched, requests[0]


def test_a_decode_gets_a_draft_from_its_own_tokens():
    sched, request = running()
    (chunk,) = sched.schedule().chunks
    assert chunk.draft == [4, 5, 6, 1] and chunk.num_tokens == 5 and chunk.samples
    assert len(chunk.block_ids) == sched.kv.blocks_needed(request.num_tokens + 4)


def test_a_rejection_rolls_back_tokens_and_blocks():
    sched, request = running()
    (chunk,) = sched.schedule().chunks
    assert sched.advance(chunk, [4, 5, 99]) == 3  # two accepted, the third position corrected
    assert request.output_token_ids == [3, 4, 5, 99]
    assert request.num_computed_tokens == request.num_tokens - 1  # 99's KV comes next step
    assert len(sched.kv.block_ids("r")) == sched.kv.blocks_needed(request.num_computed_tokens)
    assert (request.num_drafted_tokens, request.num_accepted_tokens) == (4, 2)
    for token in (1, 2):  # no n-gram ends in 99 or (99, 1): plain decodes, until (1, 2) matches again
        (chunk,) = sched.schedule().chunks
        assert not chunk.draft and sched.advance(chunk, [token]) == 1
    (chunk,) = sched.schedule().chunks
    assert chunk.draft and len(chunk.block_ids) > sched.kv.blocks_needed(request.num_computed_tokens + 1)
    used = sched.kv.num_used_blocks
    assert sched.advance(chunk, [77]) == 1  # the whole draft rejected: the blocks held for it go back
    assert sched.kv.num_used_blocks < used
    assert len(sched.kv.block_ids("r")) == sched.kv.blocks_needed(request.num_computed_tokens)


def test_a_stop_token_inside_an_accepted_run_ends_it_there():
    sched, request = running(stop={5})
    (chunk,) = sched.schedule().chunks
    assert sched.advance(chunk, [4, 5, 6, 1, 2]) == 2  # all accepted, but 5 stops
    assert request.output_token_ids == [3, 4, 5]
    assert request.status is RequestStatus.FINISHED_STOPPED and request.stop_reason == 5
    assert sched.kv.num_used_blocks == 0 and not sched.has_unfinished


def test_drafts_never_reach_past_max_tokens():
    sched, request = running(max_tokens=4)
    (chunk,) = sched.schedule().chunks
    assert chunk.draft == [4, 5]  # with the token after them, the 3rd and 4th of 4
    assert sched.advance(chunk, [4, 5, 6]) == 3
    assert request.output_token_ids == [3, 4, 5, 6] and request.status is RequestStatus.FINISHED_LENGTH


def test_the_draft_length_weighs_acceptance_against_the_cost_of_rows():
    # One stream, a step costing 2 + M rows: a drafted position pays if kept with probability 1/3.
    sched, request = running(max_tokens=200, max_draft=8, base_rows=2.0)
    lengths = []
    for _ in range(10):  # every draft accepted: longer drafts
        (chunk,) = sched.schedule().chunks
        lengths.append(len(chunk.draft))
        last = chunk.draft[-1] if chunk.draft else request.output_token_ids[-1]
        sched.advance(chunk, chunk.draft + [last % 6 + 1])  # the cycle 1..6 goes on
    # 1, then 6: the first draft, accepted whole, starts a run, which drafts all it can at once
    # (the latest match is one cycle back, and only 6 tokens follow it)
    assert lengths == [1] + [6] * 9
    for _ in range(10):  # every draft rejected: drafting stops, then probes one token now and then
        (chunk,) = sched.schedule().chunks
        lengths.append(len(chunk.draft))
        sched.advance(chunk, [1000 + len(lengths)])
    assert lengths[-1] == 0


def test_drafts_never_take_a_step_past_the_fast_path_rows():
    sched, request = running(max_decode_rows=3)
    (chunk,) = sched.schedule().chunks
    assert len(chunk.draft) == 2  # 1 decode row + 2 drafted


def test_drafts_fill_the_free_rows_of_a_one_block_step_and_open_no_other():
    # The backend takes rows in blocks of 4: one stream drafts 3 (one block), two streams 2 in all,
    # oldest first; 4 streams none, and 6 streams none either: a step of more than one block is
    # split between threads by rows, where the second block's free rows are not free.
    sched, _ = running(row_block=4)
    (chunk,) = sched.schedule().chunks
    assert chunk.draft == [4, 5, 6]
    for streams, drafts in ((2, [2, 0]), (4, [0, 0, 0, 0]), (6, [0, 0, 0, 0, 0, 0])):
        sched, _ = running(row_block=4, streams=streams)
        chunks = sched.schedule().chunks
        assert [len(c.draft) for c in chunks] == drafts
        assert not any(c.draft for c in chunks) or sum(c.num_tokens for c in chunks) == 4


def _decode_step(rows: int, sched: Scheduler) -> SchedulerOutput:
    """A step of one decode row with `rows - 1` drafted tokens."""
    request = sched.running[0]
    return SchedulerOutput([ScheduledChunk(request, request.num_computed_tokens, rows, [], list(range(rows - 1)))])


def test_a_base_of_0_is_measured_on_the_decode_steps_and_a_set_one_is_kept():
    measured, _ = running(base_rows=0)
    fixed, _ = running(base_rows=3.0)
    assert measured.step_base_rows == PRIOR_BASE_ROWS and fixed.step_base_rows == 3.0
    assert measured._draft_room(1)[1] == pytest.approx(1 / (PRIOR_BASE_ROWS + 1))
    for sched in (measured, fixed):
        prefill = ScheduledChunk(sched.running[0], 0, 6, [])  # 6 prompt tokens: not a decode step
        for _ in range(REFIT_EVERY):
            for rows in (1, 5):  # 5 ms fixed, 1 ms a row
                sched.observe(_decode_step(rows, sched), (5 + rows) / 1000)
            sched.observe(SchedulerOutput([prefill]), 1.0)
    assert measured.step_base_rows == pytest.approx(5.0) and fixed.step_base_rows == 3.0
    # a drafted position now pays if kept with probability 1 / (5 + 1): longer drafts than before
    assert measured._draft_room(1)[1] == pytest.approx(1 / 6)
