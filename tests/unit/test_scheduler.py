"""Scheduler: budgets, chunked prefill, preemption, finish, and a simulated engine loop."""
from __future__ import annotations

import pytest

from forge_service.config import SchedulerConfig
from forge_service.engine.outputs import SchedulerOutput
from forge_service.engine.request import Request, RequestStatus, SamplingParams
from forge_service.engine.scheduler import Scheduler
from forge_service.errors import InvalidArgument
from forge_service.kv_cache.manager import KVCacheManager


def make_scheduler(num_blocks=100, block_size=4, max_tokens=512, max_seqs=64) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=max_tokens, max_num_seqs=max_seqs)
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def make_request(request_id: str, prompt_len: int, max_tokens: int = 16, stop=frozenset()) -> Request:
    return Request(request_id, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   stop_token_set=frozenset(stop))


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def step(sched: Scheduler, token: int = 7, samples: list | None = None) -> tuple[SchedulerOutput, list[Request]]:
    """schedule + update; `samples` receives chunk.samples as seen before update (it is a live property)."""
    out = sched.schedule()
    flags = [c.samples for c in out.chunks]
    if samples is not None:
        samples += flags
    sampled = {c.request.request_id: token for c, f in zip(out.chunks, flags) if f}
    return out, sched.update(out, sampled)


def test_token_budget_chunks_the_last_admitted_prompt():
    sched = make_scheduler(max_tokens=10)
    for rid, n in [("a", 6), ("b", 6), ("c", 7)]:
        sched.add(make_request(rid, n))
    samples = []
    out, got = step(sched, samples=samples)
    assert plan(out) == [("a", 0, 6), ("b", 0, 4)]
    assert samples == [True, False]
    assert [r.request_id for r in got] == ["a"]
    # Decode for a, the rest of b's prompt, then c takes what is left.
    out, got = step(sched)
    assert plan(out) == [("a", 6, 1), ("b", 4, 2), ("c", 0, 7)]
    assert [r.request_id for r in got] == ["a", "b", "c"]
    assert out.num_tokens == 10


def test_max_num_seqs_limits_running_requests():
    sched = make_scheduler(max_seqs=2)
    for rid in "abc":
        sched.add(make_request(rid, 3))
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 3), ("b", 0, 3)]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    out, _ = step(sched)
    assert plan(out) == [("a", 3, 1), ("b", 3, 1)]


def test_chunked_prefill_over_several_steps():
    sched = make_scheduler(max_tokens=4, block_size=4)
    sched.add(make_request("a", 10))
    chunks, samples = [], []
    for _ in range(4):
        out, _ = step(sched, token=42, samples=samples)
        chunks += [(c.start, c.num_tokens, c.block_ids) for c in out.chunks]
    assert [c + (s,) for c, s in zip(chunks, samples)] == [
        (0, 4, [0], False),
        (4, 4, [0, 1], False),
        (8, 2, [0, 1, 2], True),
        (10, 1, [0, 1, 2], True),  # decode of the first sampled token
    ]
    assert sched.get("a").output_token_ids == [42, 42]


def test_decodes_are_scheduled_before_new_prefills():
    sched = make_scheduler(max_tokens=8)
    sched.add(make_request("a", 5))
    step(sched)
    sched.add(make_request("b", 20))
    out, _ = step(sched)
    assert plan(out) == [("a", 5, 1), ("b", 0, 7)]
    assert sched.get("b").status is RequestStatus.RUNNING


def test_preemption_picks_the_newest_and_requeues_it_at_the_front():
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add(make_request("a", 4))
    sched.add(make_request("b", 4))
    out, _ = step(sched, token=5)
    assert [c.block_ids for c in out.chunks] == [[0, 1], [2, 3]]
    sched.add(make_request("c", 1))
    # a needs a third block for its 5th token: b (newest) goes.
    out, got = step(sched, token=6)
    assert plan(out) == [("a", 4, 1)]
    assert out.chunks[0].block_ids == [0, 1, 3]  # b's blocks were freed tail first
    b = sched.get("b")
    assert out.preempted == [b]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert b.output_token_ids == [5]
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert sched.kv.block_ids("b") == []
    assert [r.request_id for r in got] == ["a"]


def test_preempted_request_recomputes_prompt_and_outputs():
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add(make_request("a", 4, max_tokens=2))
    sched.add(make_request("b", 4))
    step(sched, token=5)
    step(sched, token=6)  # b preempted; a samples its 2nd token and finishes
    assert sched.get("a") is None and sched.kv.num_free_blocks == 4
    samples = []
    out, got = step(sched, token=9, samples=samples)
    # b recomputes prompt + its one output token and samples only the next one.
    assert plan(out) == [("b", 0, 5)] and samples == [True]
    assert got[0].output_token_ids == [5, 9]


def test_newest_request_needing_room_preempts_itself():
    sched = make_scheduler(num_blocks=2, block_size=4)
    sched.add(make_request("a", 3))
    sched.add(make_request("b", 4))
    step(sched)
    # a's 4th token fits in its block; b's 5th needs a block nobody can give.
    out, _ = step(sched)
    assert plan(out) == [("a", 3, 1)]
    assert [r.request_id for r in out.preempted] == ["b"]
    assert sched.kv.block_ids("a") == [0] and sched.kv.num_free_blocks == 1


def test_a_request_preempted_in_a_step_is_not_readmitted_in_it():
    sched = make_scheduler(num_blocks=4, block_size=2, max_tokens=3)
    sched.add(make_request("a", 2))
    sched.add(make_request("b", 2))
    for _ in range(3):
        step(sched)
    assert (sched.kv.block_ids("a"), sched.kv.block_ids("b")) == ([0, 2], [1, 3])
    # a's 5th token needs a block: b goes, and though a 2-token chunk of b would fit now, b waits.
    out, _ = step(sched)
    assert plan(out) == [("a", 4, 1)]
    assert [r.request_id for r in out.preempted] == ["b"]
    assert sched.kv.num_free_blocks == 1 and [r.request_id for r in sched.waiting] == ["b"]
    out, _ = step(sched)
    assert plan(out) == [("a", 5, 1), ("b", 0, 2)]
    assert [r.request_id for r in sched.running] == ["a", "b"]


def test_a_waiting_head_that_does_not_fit_blocks_the_queue():
    sched = make_scheduler(num_blocks=4, block_size=2)
    sched.add(make_request("a", 5))
    sched.add(make_request("b", 6))
    sched.add(make_request("c", 1))
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 5)]  # c would fit, but b is first
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_finish_frees_blocks_and_dequeues():
    sched = make_scheduler(num_blocks=8, block_size=2, max_tokens=9)
    for rid in "abcd":
        sched.add(make_request(rid, 3))
    step(sched)  # a, b, c running; d waiting
    a = sched.finish("a", RequestStatus.FINISHED_ABORTED)
    assert a.status is RequestStatus.FINISHED_ABORTED and a.status.finish_reason == "abort"
    assert sched.kv.block_ids("a") == [] and sched.kv.num_used_blocks == 4
    d = sched.finish("d", RequestStatus.FINISHED_ABORTED)
    assert d is not None and sched.num_waiting == 0
    assert sched.finish("a", RequestStatus.FINISHED_ABORTED) is None
    assert sched.finish("zzz", RequestStatus.FINISHED_STOPPED) is None
    assert [r.request_id for r in sched.running] == ["b", "c"]


def test_finish_between_schedule_and_update_is_skipped():
    sched = make_scheduler()
    sched.add(make_request("a", 3))
    sched.add(make_request("b", 3))
    out = sched.schedule()
    sched.finish("a", RequestStatus.FINISHED_STOPPED)
    got = sched.update(out, {"a": 1, "b": 2})
    assert [r.request_id for r in got] == ["b"]
    assert out.chunks[0].request.output_token_ids == []
    assert sched.kv.block_ids("a") == []
    assert plan(sched.schedule()) == [("b", 3, 1)]


def test_stop_token_and_max_tokens_finish_and_free():
    sched = make_scheduler()
    sched.add(make_request("a", 3, stop={7}))
    sched.add(make_request("b", 3, max_tokens=1))
    out, got = step(sched, token=7)
    assert [r.status for r in got] == [RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH]
    assert got[0].stop_reason == 7
    assert not sched.has_unfinished and sched.kv.num_used_blocks == 0


def test_prompt_that_can_never_fit_is_rejected():
    sched = make_scheduler(num_blocks=2, block_size=4)
    assert sched.can_ever_fit(8) and not sched.can_ever_fit(9)
    with pytest.raises(InvalidArgument):
        sched.add(make_request("a", 9))
    with pytest.raises(InvalidArgument):
        sched.add(make_request("e", 0))
    assert not sched.has_unfinished


def test_request_outgrowing_the_whole_cache_finishes_with_length():
    sched = make_scheduler(num_blocks=2, block_size=2)
    sched.add(make_request("a", 3, max_tokens=10))
    step(sched)
    _, got = step(sched)
    assert got[0].status is RequestStatus.FINISHED_LENGTH
    assert got[0].output_token_ids == [7, 7]  # 5 tokens: the 5th's KV would need a 3rd block
    assert not sched.has_unfinished and sched.schedule().empty


# --- a simulated engine loop --------------------------------------------------------------

BLOCK_SIZE = 4


def fake_next_token(request_id: str, tokens: list[int]) -> int:
    """A deterministic "model": the next token depends on the request id and every token so far."""
    h = sum(map(ord, request_id))
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return h % 50


class FakeRunner:
    """Writes each chunk's tokens into a paged 'KV cache' and samples from what it reads back,
    so a wrong block table or a block shared by mistake changes the output."""

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}

    def run(self, out: SchedulerOutput) -> dict[str, int]:
        for c in out.chunks:  # write every chunk first, as one batched forward pass would
            for pos, token in enumerate(c.request.token_ids_slice(c.start, c.end), start=c.start):
                self.slots[self.slot(c.block_ids, pos)] = token
        sampled = {}
        for c in out.chunks:
            if c.samples:
                seen = [self.slots[self.slot(c.block_ids, pos)] for pos in range(c.end)]
                sampled[c.request.request_id] = fake_next_token(c.request.request_id, seen)
        return sampled

    @staticmethod
    def slot(block_ids: list[int], pos: int) -> int:
        return block_ids[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def run_alone(request: Request) -> list[int]:
    tokens = list(request.prompt_token_ids)
    for _ in range(request.sampling_params.max_tokens):
        tokens.append(fake_next_token(request.request_id, tokens))
        if tokens[-1] in request.stop_token_set:
            break
    return tokens[request.num_prompt_tokens:]


def test_simulated_loop_with_a_tiny_pool_loses_nothing():
    sched = make_scheduler(num_blocks=10, block_size=BLOCK_SIZE, max_tokens=12, max_seqs=4)
    requests = [Request(f"r{i}", [(i * 7 + j) % 50 for j in range(3 + (i * 5) % 17)],
                        SamplingParams(max_tokens=4 + (i * 3) % 13), stop_token_set=frozenset({49}))
                for i in range(14)]
    expected = {r.request_id: run_alone(r) for r in requests}
    pending = list(requests)
    runner, finished, steps = FakeRunner(), [], 0
    while pending or sched.has_unfinished:
        if pending and steps % 3 == 0:  # staggered arrivals
            sched.add(pending.pop(0))
        out = sched.schedule()
        ids = [c.request.request_id for c in out.chunks]
        assert len(ids) == len(set(ids)) <= 4 and out.num_tokens <= 12
        assert sched.kv.num_used_blocks <= 10
        queued = [int(r.request_id[1:]) for r in sched.running + list(sched.waiting)]
        assert queued == sorted(queued)  # arrival order, preempted requests included
        finished += [r for r in sched.update(out, runner.run(out)) if r.status.finished]
        steps += 1
        assert steps < 1000, "the scheduler stopped making progress"
    assert sorted(r.request_id for r in finished) == sorted(expected)
    assert {r.request_id: r.output_token_ids for r in finished} == expected
    assert sum(r.num_preemptions for r in requests) > 0
    assert sched.kv.num_free_blocks == 10


def test_while_streams_decode_prefill_chunks_get_what_is_left_of_a_bounded_step():
    config = SchedulerConfig(max_num_batched_tokens=512, max_tokens_while_decoding=40)
    sched = Scheduler(config, KVCacheManager(400, 4))
    for rid in "abc":
        sched.add(make_request(rid, 5, max_tokens=3))
    out, _ = step(sched)
    assert out.num_tokens == 15  # nothing decodes yet: prefills take the full budget
    sched.add(make_request("long", 300, max_tokens=2))
    out, _ = step(sched)
    assert plan(out) == [("a", 5, 1), ("b", 5, 1), ("c", 5, 1), ("long", 0, 37)]  # 40 - 3 decodes
    out, _ = step(sched)
    assert plan(out) == [("a", 6, 1), ("b", 6, 1), ("c", 6, 1), ("long", 37, 37)]
    out, _ = step(sched)  # a, b, c finished with max_tokens: the long prompt runs alone again
    assert plan(out) == [("long", 74, 226)]


def test_a_full_batch_of_decodes_still_lets_a_block_of_prompt_in():
    config = SchedulerConfig(max_num_batched_tokens=512, max_tokens_while_decoding=40)
    sched = Scheduler(config, KVCacheManager(400, 4))
    for i in range(50):
        sched.add(make_request(f"d{i}", 2, max_tokens=10))
    step(sched)
    sched.add(make_request("new", 30))
    out, _ = step(sched)
    assert plan(out)[-1] == ("new", 0, 4)  # one block, though 50 decodes exceed the bound
    unbounded = Scheduler(SchedulerConfig(max_num_batched_tokens=512, max_tokens_while_decoding=0),
                          KVCacheManager(400, 4))
    for i in range(50):
        unbounded.add(make_request(f"d{i}", 2, max_tokens=10))
    step(unbounded)
    unbounded.add(make_request("new", 30))
    out, _ = step(unbounded)
    assert plan(out)[-1] == ("new", 0, 30)


def test_while_streams_decode_prefill_chunks_fit_the_step_time_at_the_measured_cost_of_a_token():
    config = SchedulerConfig(max_num_batched_tokens=512, max_tokens_while_decoding=128, max_step_ms_while_decoding=50)
    sched = Scheduler(config, KVCacheManager(400, 4))
    for rid in "abc":
        sched.add(make_request(rid, 5, max_tokens=20))
    out, _ = step(sched)
    sched.observe(out, 0.030)  # 15 prompt tokens in 30 ms: 2 ms a token
    assert sched.token_ms == 2.0
    sched.add(make_request("long", 300, max_tokens=2))
    out, _ = step(sched)
    assert plan(out)[-1] == ("long", 0, 22)  # 50 ms hold 25 tokens; 3 of them are decodes
    sched.observe(out, 0.100)  # 4 ms a token: the cost moves a quarter of the way, to 2.5 ms
    out, _ = step(sched)
    assert plan(out)[-1] == ("long", 22, 17)  # 20 tokens - 3 decodes
    sched.observe(out, 10.0)  # however dear a token gets, a block of the prompt still comes in
    out, _ = step(sched)
    assert plan(out)[-1] == ("long", 39, 4)
    cost = sched.token_ms
    sched.observe(SchedulerOutput(chunks=[c for c in out.chunks if c.num_tokens == 1]), 5.0)
    assert sched.token_ms == cost  # steps that only decode do not measure it


def test_the_step_time_bound_is_off_at_zero_and_never_loosens_the_token_bound():
    for ms, chunk in ((0, 125), (10_000, 125)):
        config = SchedulerConfig(max_num_batched_tokens=512, max_tokens_while_decoding=128,
                                 max_step_ms_while_decoding=ms)
        sched = Scheduler(config, KVCacheManager(400, 4))
        for rid in "abc":
            sched.add(make_request(rid, 5, max_tokens=20))
        out, _ = step(sched)
        sched.observe(out, 0.030)
        sched.add(make_request("long", 300, max_tokens=2))
        out, _ = step(sched)
        assert plan(out)[-1] == ("long", 0, chunk)
