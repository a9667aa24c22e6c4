"""AsyncEngine: the engine thread, per-request streams, aborts, bounds, failures (fake engine)."""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable

import pytest

from forge_service.engine.async_engine import AsyncEngine
from forge_service.engine.output_types import CompletionOutput, RequestOutput
from forge_service.engine.request import SamplingParams
from forge_service.errors import ForgeError, InvalidArgument, QueueFull, Unavailable
from tests.unit.fakes import FakeEngine, until


def run(body: Callable[[AsyncEngine], Awaitable[Any]], engine: FakeEngine | None = None,
        max_waiting: int = 0, hold_outputs_from: int = 1) -> Any:
    async def main() -> Any:
        async_engine = AsyncEngine(engine or FakeEngine(), max_waiting=max_waiting,
                                   hold_outputs_from=hold_outputs_from)
        async_engine.start()
        try:
            return await asyncio.wait_for(body(async_engine), timeout=10)
        finally:
            await async_engine.shutdown()

    return asyncio.run(main())


async def collect(engine: AsyncEngine, request_id: str, prompt: bytes, **params: Any) -> dict[int, str]:
    texts: dict[int, str] = {}
    params.setdefault("max_tokens", len(prompt))
    async for output in engine.generate(request_id, list(prompt), SamplingParams(**params)):
        for completion in output.outputs:
            texts[completion.index] = texts.get(completion.index, "") + completion.text
    return texts


def test_streams_deltas_until_finished_and_steps_on_one_other_thread() -> None:
    fake = FakeEngine()
    texts = run(lambda e: collect(e, "r1", b"hello", max_tokens=5), fake)
    assert texts == {0: "hello"}
    assert fake.thread_ids and threading.get_ident() not in fake.thread_ids
    assert len(fake.thread_ids) == 1
    assert fake.aborted == []  # finished normally: no abort


def test_n_completions_are_streamed_together() -> None:
    texts = run(lambda e: collect(e, "r1", b"abc", n=2, max_tokens=3))
    assert texts == {0: "abc", 1: "bca"}


def test_concurrent_requests_get_their_own_streams() -> None:
    async def body(e: AsyncEngine) -> list[dict[int, str]]:
        return await asyncio.gather(*(collect(e, f"r{i}", f"req{i}".encode(), max_tokens=4) for i in range(5)))

    assert run(body) == [{0: f"req{i}"} for i in range(5)]


def test_consumer_that_stops_early_aborts_the_request() -> None:
    fake = FakeEngine(step_delay_s=0.01)

    async def body(e: AsyncEngine) -> None:
        stream = e.generate("r1", list(b"x" * 50), SamplingParams(max_tokens=50))
        async for _ in stream:
            break
        await stream.aclose()
        await until(lambda: fake.aborted == ["r1"])
        assert not fake.has_unfinished_requests()

    run(body, fake)


def test_cancelled_consumer_aborts_the_request() -> None:
    fake = FakeEngine(step_delay_s=0.01)

    async def body(e: AsyncEngine) -> None:
        task = asyncio.create_task(collect(e, "r1", b"y" * 50, max_tokens=50))
        await until(lambda: fake.steps >= 2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: fake.aborted == ["r1"])
        assert e.num_in_flight == 0

    run(body, fake)


def test_full_waiting_queue_refuses_at_once() -> None:
    fake = FakeEngine(max_running=1)
    fake.gate = threading.Event()  # the engine thread blocks inside step()

    async def body(e: AsyncEngine) -> None:
        tasks = [asyncio.create_task(collect(e, f"r{i}", b"z" * 40, max_tokens=40)) for i in range(2)]
        await until(lambda: fake.stepped.is_set() and e.num_in_flight == 2)
        # Refused while the engine thread is still stuck in its step: no round trip to it.
        with pytest.raises(QueueFull, match="2 requests waiting, the bound is 2"):
            await collect(e, "late", b"late")
        assert "late" not in fake.added
        fake.gate.set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    run(body, fake, max_waiting=2)


def test_pending_adds_count_against_the_bound_before_the_engine_sees_them() -> None:
    fake = FakeEngine(max_running=0)
    fake.gate = threading.Event()

    async def body(e: AsyncEngine) -> None:
        first = asyncio.create_task(collect(e, "a", b"a"))
        await until(lambda: fake.stepped.is_set())  # the engine thread is inside a blocked step
        second = asyncio.create_task(collect(e, "b", b"b"))
        await asyncio.sleep(0.01)
        assert fake.added == ["a"] and e.stats().num_waiting == 1
        with pytest.raises(QueueFull):
            await collect(e, "c", b"c")
        fake.gate.set()
        for task in (first, second):
            task.cancel()
        await asyncio.gather(first, second, return_exceptions=True)

    run(body, fake, max_waiting=2)


def test_a_request_takes_n_places_in_the_bound() -> None:
    async def body(e: AsyncEngine) -> None:
        with pytest.raises(QueueFull, match="0 requests waiting and this request adds 3, the bound is 2"):
            await collect(e, "wide", b"abc", n=3)
        assert await collect(e, "narrow", b"abc", n=2) == {0: "abc", 1: "bca"}

    run(body, max_waiting=2)


def test_engine_errors_on_add_reach_only_that_request() -> None:
    fake = FakeEngine(max_model_len=8)

    async def body(e: AsyncEngine) -> None:
        with pytest.raises(InvalidArgument, match="prompt has 9 tokens"):
            await collect(e, "long", b"123456789")
        with pytest.raises(InvalidArgument, match="top_p"):
            await collect(e, "bad", b"ok", top_p=0.0)
        fake.block_adds = True
        with pytest.raises(QueueFull):
            await collect(e, "full", b"ok")
        fake.block_adds = False
        assert await collect(e, "good", b"fine") == {0: "fine"}

    run(body, fake)


def test_step_failure_fails_in_flight_requests_and_the_loop_goes_on() -> None:
    fake = FakeEngine()

    async def body(e: AsyncEngine) -> None:
        fake.fail_steps = 1
        results = await asyncio.gather(collect(e, "a", b"aaaa"), collect(e, "b", b"bbbb"), return_exceptions=True)
        for result in results:
            assert isinstance(result, ForgeError) and result.code == "INTERNAL"
            assert "error id" in str(result)
        assert sorted(fake.aborted) == ["a", "b"]
        assert await collect(e, "c", b"after") == {0: "after"}

    run(body, fake)


def test_idle_engine_thread_does_not_step() -> None:
    fake = FakeEngine()

    async def body(e: AsyncEngine) -> None:
        await collect(e, "r1", b"abc")
        steps = fake.steps
        await asyncio.sleep(0.2)
        assert fake.steps == steps

    run(body, fake)


def test_duplicate_request_id_is_refused() -> None:
    fake = FakeEngine(step_delay_s=0.01)

    async def body(e: AsyncEngine) -> None:
        task = asyncio.create_task(collect(e, "same", b"q" * 30, max_tokens=30))
        await until(lambda: fake.steps >= 1)
        with pytest.raises(InvalidArgument, match="already in flight"):
            await collect(e, "same", b"q")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    run(body, fake)


def test_shutdown_fails_in_flight_requests_and_refuses_new_ones() -> None:
    fake = FakeEngine(step_delay_s=0.01)

    async def main() -> None:
        e = AsyncEngine(fake)
        e.start()
        task = asyncio.create_task(collect(e, "r1", b"s" * 50, max_tokens=50))
        await until(lambda: fake.steps >= 1)
        await e.shutdown()
        with pytest.raises(Unavailable):
            await task
        with pytest.raises(Unavailable):
            await collect(e, "r2", b"x")
        assert fake.aborted == ["r1"]

    asyncio.run(main())


def test_stats_are_a_snapshot_from_the_engine_thread() -> None:
    fake = FakeEngine(step_delay_s=0.02)

    async def body(e: AsyncEngine) -> None:
        task = asyncio.create_task(collect(e, "r1", b"k" * 20, max_tokens=20))
        await until(lambda: e.stats().num_running == 1)
        assert e.stats().kv_blocks_used == 2
        await task
        await until(lambda: e.stats().num_running == 0)

    run(body, fake)


class HeldAfterFirstStep(FakeEngine):
    """Steps once, then waits for `release` before each further step; step `fail_at` raises."""

    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__()
        self.release = threading.Event()
        self.fail_at = fail_at

    def step(self, on_launch: Callable[[], None] | None = None) -> list[Any]:
        if on_launch is not None:
            on_launch()  # launched: the last step's outputs are out while this one is held
        if self.steps >= 1:
            self.release.wait(10)
        if self.steps == self.fail_at:
            self.steps += 1
            raise RuntimeError("fake step failure")
        return super().step()


class HeldBeforeLaunch(FakeEngine):
    """Each step after the first waits for `launch` before its model run starts (a long schedule)."""

    def __init__(self) -> None:
        super().__init__()
        self.scheduling = threading.Event()
        self.launch = threading.Event()

    def step(self, on_launch: Callable[[], None] | None = None) -> list[Any]:
        if self.steps >= 1:
            self.scheduling.set()
            self.launch.wait(10)
        return super().step(on_launch)


def test_a_large_step_s_outputs_go_out_as_the_next_step_launches_or_at_once_when_none_follows() -> None:
    # The loop's per-token work then overlaps the next model run instead of contending for the
    # GIL with the engine thread's Python between steps.
    fake = HeldBeforeLaunch()

    async def body(e: AsyncEngine) -> None:
        stream = e.generate("r1", list(b"ab"), SamplingParams(max_tokens=2))
        first = asyncio.ensure_future(stream.__anext__())
        await until(fake.scheduling.is_set)
        await asyncio.sleep(0.2)
        assert not first.done()  # held until the next step hands its batch to the model
        fake.launch.set()
        texts = [(await first).outputs[0].text]  # "a", or "ab" where the last step's came too
        texts += [output.outputs[0].text async for output in stream]  # no step follows the last: out at once
        assert "".join(texts) == "ab"

    run(body, fake, hold_outputs_from=1)


def test_a_small_step_s_outputs_go_out_at_once() -> None:
    fake = HeldBeforeLaunch()

    async def body(e: AsyncEngine) -> None:
        stream = e.generate("r1", list(b"ab"), SamplingParams(max_tokens=2))
        assert (await stream.__anext__()).outputs[0].text == "a"  # before the next step may launch
        fake.launch.set()
        assert [output.outputs[0].text async for output in stream] == ["b"]

    run(body, fake, hold_outputs_from=2)


def test_deltas_that_queue_up_while_the_consumer_is_away_come_as_one() -> None:
    fake = HeldAfterFirstStep()

    async def body(e: AsyncEngine) -> None:
        stream = e.generate("r1", list(b"coalescing"), SamplingParams(max_tokens=10, logprobs=1))
        first = await stream.__anext__()
        assert first.outputs[0].token_ids == [ord("c")]
        fake.release.set()  # nine more steps while this consumer is away
        await until(lambda: e._streams["r1"].qsize() == 9)
        rest = [output async for output in stream]
        assert len(rest) == 1 and rest[0].finished
        merged = rest[0].outputs[0]
        assert merged.token_ids == list(b"oalescing") and merged.text == "oalescing"
        assert [lp[0].token_id for lp in merged.logprobs] == list(b"oalescing")
        assert merged.finish_reason == "length"

    run(body, fake)


def test_a_failure_after_queued_deltas_comes_after_them() -> None:
    fake = HeldAfterFirstStep(fail_at=4)

    async def body(e: AsyncEngine) -> None:
        stream = e.generate("r1", list(b"coalescing"), SamplingParams(max_tokens=10))
        texts = [(await stream.__anext__()).outputs[0].text]
        fake.release.set()  # three more tokens, then the step fails
        await until(lambda: e._streams["r1"].qsize() == 4)
        with pytest.raises(ForgeError, match="internal engine error"):
            async for output in stream:
                texts.append(output.outputs[0].text)
        assert texts == ["c", "oal"]

    run(body, fake)


def test_extend_folds_each_completion_in_order_and_keeps_the_others() -> None:
    merged = RequestOutput("r", [1], [CompletionOutput(0, "a", [97]), CompletionOutput(1, "x", [120])])
    merged.extend(RequestOutput("r", [1], [CompletionOutput(1, "y", [121], finish_reason="stop", stop_reason=121)]))
    merged.extend(RequestOutput("r", [1], [CompletionOutput(0, "b", [98], finish_reason="length"),
                                           CompletionOutput(2, "z", [122])], finished=True))
    assert [(o.index, o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in merged.outputs] == [
        (0, "ab", [97, 98], "length", None), (1, "xy", [120, 121], "stop", 121), (2, "z", [122], None, None)]
    assert merged.finished
