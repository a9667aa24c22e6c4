"""Priority scheduling (--scheduling-policy priority): order by (priority, arrival), preemption of
the lowest-ranked, a waiting request that outranks running ones makes room; outputs unchanged;
the fcfs server refuses a priority; the field through the gateway and the service."""
from __future__ import annotations

import httpx
import pytest

from forge_service import LLM, SamplingParams
from forge_service.config import SchedulerConfig
from forge_service.engine.request import Request
from forge_service.engine.scheduler import Scheduler
from forge_service.errors import InvalidArgument
from forge_service.kv_cache.manager import KVCacheManager
from tests.unit.test_engine_tiny import tiny_dir  # noqa: F401 (a fixture: the sharp tiny model)
from tests.unit.test_gateway import chat_body, fake, http, stack  # noqa: F401 (fixtures)
from tests.unit.test_scheduler import plan, step
from tests.unit.test_speculative_engine import LOOPING


def _scheduler(num_blocks: int = 100, max_seqs: int = 64, policy: str = "priority") -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=max_seqs, scheduling_policy=policy)
    return Scheduler(config, KVCacheManager(num_blocks, 4))


def _request(request_id: str, priority: int = 0, prompt_len: int = 4) -> Request:
    return Request(request_id, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=16, priority=priority))


def test_requests_start_by_priority_then_arrival():
    sched = _scheduler(max_seqs=2)
    for rid, priority in [("a", 5), ("b", 0), ("c", 5), ("d", -1)]:
        sched.add(_request(rid, priority))
    out, _ = step(sched)
    assert [rid for rid, _, _ in plan(out)] == ["d", "b"]
    assert [r.request_id for r in sched.waiting] == ["a", "c"]


def test_a_request_that_outranks_running_ones_takes_a_seat():
    """Both seats held by low-priority decodes: a high-priority arrival preempts the later of them
    and starts in the same step; the preempted one waits ahead of an equal-ranked later arrival."""
    sched = _scheduler(max_seqs=2)
    for rid in "ab":
        sched.add(_request(rid, priority=3))
    step(sched)
    sched.add(_request("late", priority=3))
    sched.add(_request("urgent", priority=0))
    out, _ = step(sched)
    assert [r.request_id for r in out.preempted] == ["b"]
    assert sorted(rid for rid, _, _ in plan(out)) == ["a", "urgent"]
    assert [r.request_id for r in sched.running] == ["urgent", "a"]
    assert [r.request_id for r in sched.waiting] == ["b", "late"]


def test_a_request_that_outranks_running_ones_gets_their_blocks():
    """Seats to spare but the KV cache full: the lowest-ranked running requests give their blocks."""
    sched = _scheduler(num_blocks=6)
    for rid in "ab":
        sched.add(_request(rid, priority=1, prompt_len=8))  # 2 blocks each, a third at the first decode
    step(sched)
    step(sched)
    sched.add(_request("urgent", priority=0, prompt_len=8))
    out, _ = step(sched)
    assert [r.request_id for r in out.preempted] == ["b"] and ("urgent", 0, 8) in plan(out)


def test_fcfs_never_preempts_for_a_waiting_request():
    sched = _scheduler(max_seqs=2, policy="fcfs")
    for rid in "ab":
        sched.add(_request(rid))
    step(sched)
    sched.add(_request("c"))
    out, _ = step(sched)
    assert not out.preempted and [rid for rid, _, _ in plan(out)] == ["a", "b"]


def test_preempted_low_priority_output_is_unchanged(tiny_dir):  # noqa: F811
    """One seat: a high-priority request arriving mid-generation runs first; the low-priority one,
    preempted and recomputed, ends with the tokens it has alone."""
    llm = LLM(model=str(tiny_dir), dtype="float32", scheduling_policy="priority", max_num_seqs=1, speculative="off")
    params = dict(temperature=0, max_tokens=24, ignore_eos=True)
    [alone] = llm.generate([LOOPING[0]], SamplingParams(**params))
    engine = llm.engine
    tokens: dict[str, list[int]] = {"low": [], "high": []}
    finished = []

    def steps(count: int | None = None) -> None:
        while engine.has_unfinished_requests() and (count is None or count > 0):
            for delta in engine.step():
                tokens[delta.request_id] += delta.outputs[0].token_ids
                finished.extend([delta.request_id] if delta.finished else [])
            count = None if count is None else count - 1

    engine.add_request("low", LOOPING[0], SamplingParams(**params, priority=2))
    steps(6)
    engine.add_request("high", LOOPING[1], SamplingParams(**params, priority=-3))
    steps()
    assert finished == ["high", "low"] and engine.scheduler.get("low") is None
    assert tokens["low"] == alone.outputs[0].token_ids and len(tokens["high"]) == 24


def test_a_first_come_first_served_engine_refuses_a_priority(tiny_dir):  # noqa: F811
    llm = LLM(model=str(tiny_dir), dtype="float32")
    with pytest.raises(InvalidArgument, match="--scheduling-policy priority") as error:
        llm.engine.add_request("r", [5, 6, 7], SamplingParams(priority=1))
    assert error.value.field == "priority"


def test_a_bad_policy_is_a_config_error():
    with pytest.raises(ValueError, match="scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")


def test_the_gateway_passes_priority_and_the_service_names_it(http: httpx.Client, fake):
    assert http.post("/v1/chat/completions", json=chat_body(priority=-5)).status_code == 200
    assert fake.requests[-1].priority == -5
    assert http.post("/v1/completions", json={"model": "fake-model", "prompt": "a", "priority": 2}).status_code == 200
    assert fake.requests[-1].priority == 2
    assert http.post("/v1/chat/completions", json=chat_body(priority=2**31)).json()["error"]["param"] == "priority"
