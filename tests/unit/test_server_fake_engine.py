"""The real grpc.aio server with a fake engine: RPCs, status codes, deadlines, cancel, health, drain."""
from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
from typing import Any, Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from forge_service import convert
from forge_service.config import ServiceConfig
from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc
from forge_service.server import ForgeService, Phase
from tests.unit.fakes import FakeEngine, until

pytestmark = pytest.mark.timeout(60)
CONFIG = ServiceConfig(host="127.0.0.1", grpc_port=0, drain_timeout_s=5.0)


class Harness:
    def __init__(self, service: ForgeService, fake: FakeEngine, channel: grpc.aio.Channel) -> None:
        self.service, self.fake, self.channel = service, fake, channel
        self.stub = pb_grpc.ForgeStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    async def readiness(self, name: str = "forge.v1.Forge") -> int:
        return (await self.health.Check(health_pb2.HealthCheckRequest(service=name))).status


def run(body: Callable[[Harness], Awaitable[Any]], fake: FakeEngine | None = None, max_waiting: int = 0,
        load: bool = True, factory: Callable[[], Any] | None = None, config: ServiceConfig = CONFIG) -> Any:
    fake = fake or FakeEngine()

    async def main() -> Any:
        service = ForgeService(config, factory or (lambda: fake), max_waiting=max_waiting)
        port = await service.start()
        if load:
            await service.load()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                return await asyncio.wait_for(body(Harness(service, fake, channel)), 30)
            finally:
                await service.stop()

    return asyncio.run(main())


def text_request(text: str, max_tokens: int | None = None, **fields: Any) -> pb.GenerateRequest:
    stopping = pb.StoppingParameters(max_tokens=max_tokens) if max_tokens else pb.StoppingParameters()
    return pb.GenerateRequest(text=text, stopping=stopping, **fields)


async def stream_all(h: Harness, request: pb.GenerateRequest, **kw: Any) -> list[pb.StreamResponse]:
    return [message async for message in h.stub.Stream(request, **kw)]


async def code_of(awaitable: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    return info.value.code(), info.value.details()


def test_unset_proto_fields_take_the_documented_defaults() -> None:
    params = convert.sampling_params(pb.GenerateRequest(text="x"))
    assert (params.n, params.temperature, params.top_p, params.top_k) == (1, 1.0, 1.0, 0)
    assert params.repetition_penalty == 1.0
    assert (params.max_tokens, params.seed, params.logprobs, params.skip_special_tokens) == (None, None, None, True)
    request = pb.GenerateRequest(
        text="x", n=3, logprobs=True, top_logprobs=0,
        sampling=pb.SamplingParameters(temperature=0.7, top_p=0.9, seed=0, logit_bias={5: -100.0}),
        stopping=pb.StoppingParameters(max_tokens=7, stop=["a", "b"], skip_special_tokens=False))
    params = convert.sampling_params(request)
    assert (params.temperature, params.top_p, params.seed, params.logit_bias) == (0.7, 0.9, 0, {5: -100.0})
    assert (params.n, params.logprobs, params.max_tokens, params.stop) == (3, 0, 7, ["a", "b"])
    assert params.skip_special_tokens is False and params.greedy is False


def test_generate_text_chat_and_token_ids() -> None:
    async def body(h: Harness) -> None:
        response = await h.stub.Generate(text_request("hello", request_id="r1"))
        assert response.request_id == "r1" and response.model == "fake-model"
        [choice] = response.choices
        assert (choice.text, list(choice.token_ids)) == ("hello", list(b"hello"))
        assert choice.finish_reason == pb.FINISH_REASON_LENGTH
        assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (5, 5)

        chat = pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi")])
        response = await h.stub.Generate(pb.GenerateRequest(chat=chat, stopping=pb.StoppingParameters(max_tokens=6)))
        assert response.choices[0].text == "<user>"  # the fake template, echoed
        assert response.usage.prompt_tokens == len("<user>hi</user><assistant>")

        tokens = pb.GenerateRequest(token_ids=pb.TokenIds(ids=list(b"abc")), n=2)
        response = await h.stub.Generate(tokens)
        assert [c.text for c in response.choices] == ["abc", "bca"]
        assert response.usage.completion_tokens == 6 and response.request_id  # an id was made up

    run(body)


def test_stream_chunks_then_one_final_per_choice() -> None:
    async def body(h: Harness) -> None:
        messages = await stream_all(h, text_request("abcd", max_tokens=3, n=2, request_id="s1"))
        assert all(m.request_id == "s1" for m in messages)
        chunks = [m.chunk for m in messages if m.HasField("chunk")]
        finals = {m.final.index: m.final for m in messages if m.HasField("final")}
        assert "".join(c.text for c in chunks if c.index == 0) == "abc"
        assert "".join(c.text for c in chunks if c.index == 1) == "bcd"
        assert finals[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert (finals[1].usage.prompt_tokens, finals[1].usage.completion_tokens) == (4, 3)
        last_index_of = {m.final.index: i for i, m in enumerate(messages) if m.HasField("final")}
        assert all(i < last_index_of[m.chunk.index] for i, m in enumerate(messages) if m.HasField("chunk"))

    run(body)


def test_matched_stop_string_and_stop_token() -> None:
    async def body(h: Harness) -> None:
        request = text_request("abcdef")
        request.stopping.stop.append("d")
        messages = await stream_all(h, request)
        final = next(m.final for m in messages if m.HasField("final"))
        assert (final.finish_reason, final.WhichOneof("matched_stop"), final.stop_string) == (
            pb.FINISH_REASON_STOP, "stop_string", "d")

        request = text_request("abcdef")
        request.stopping.stop_token_ids.append(ord("c"))
        response = await h.stub.Generate(request)
        assert response.choices[0].stop_token_id == ord("c") and response.choices[0].text == "ab"

    run(body)


def test_logprobs_are_returned_per_token() -> None:
    async def body(h: Harness) -> None:
        request = text_request("xy", logprobs=True, top_logprobs=2)
        messages = await stream_all(h, request)
        chunks = [m.chunk for m in messages if m.HasField("chunk")]
        # One position per token, however the stream grouped the tokens into chunks.
        assert [len(c.logprobs) for c in chunks] == [len(c.token_ids) for c in chunks]
        position, second = [p for c in chunks for p in c.logprobs]
        assert (position.chosen.token_id, position.chosen.token, position.chosen.bytes) == (ord("x"), "x", b"x")
        assert second.chosen.token_id == ord("y")
        assert position.chosen.logprob == pytest.approx(-0.5)
        assert [t.token for t in position.top] == ["A", "B"]

    run(body)


def test_invalid_arguments_say_what_and_by_how_much() -> None:
    async def body(h: Harness) -> None:
        bad_top_p = text_request("hi", sampling=pb.SamplingParameters(top_p=0.0))
        code, details = await code_of(h.stub.Generate(bad_top_p))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "top_p must be in (0, 1], got 0.0" in details

        code, details = await code_of(h.stub.Generate(text_request("x" * 40)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "40 tokens" in details and "context length is 32" in details and "by 9 tokens" in details

        code, details = await code_of(h.stub.Generate(pb.GenerateRequest()))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "no input" in details

        code, details = await code_of(h.stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[300]))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "300" in details

        code, details = await code_of(h.stub.Generate(text_request("hi", top_logprobs=3)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in details

        code, details = await code_of(h.stub.Generate(text_request("hi", model="gpt-9")))
        assert code == grpc.StatusCode.NOT_FOUND and "gpt-9" in details and "fake-model" in details

    run(body, FakeEngine(max_model_len=32))


def test_deadline_aborts_the_request_with_deadline_exceeded() -> None:
    fake = FakeEngine(step_delay_s=0.02)

    async def body(h: Harness) -> None:
        for call in (h.stub.Generate, h.stub.Stream):
            request = text_request("d" * 60, max_tokens=60, request_id=f"dl-{call is h.stub.Stream}")
            rpc = call(request, timeout=0.3)
            code, _ = await code_of(rpc if call is h.stub.Generate else stream_all_call(rpc))
            assert code == grpc.StatusCode.DEADLINE_EXCEEDED
            await until(lambda: request.request_id in [fake.labels[i] for i in fake.aborted])
        assert h.service.in_flight == 0

    run(body, fake)


async def stream_all_call(call: Any) -> list[Any]:
    return [message async for message in call]


def test_cancelled_stream_aborts_the_request() -> None:
    fake = FakeEngine(step_delay_s=0.02)

    async def body(h: Harness) -> None:
        call = h.stub.Stream(text_request("c" * 60, max_tokens=60, request_id="cx"))
        first = await call.read()
        assert first.chunk.text == "c"
        call.cancel()
        await until(lambda: [fake.labels[i] for i in fake.aborted] == ["cx"])
        await until(lambda: not fake.has_unfinished_requests())

    run(body, fake)


def test_full_queue_is_resource_exhausted_at_once() -> None:
    fake = FakeEngine(max_running=1)
    fake.gate = threading.Event()  # the engine thread blocks inside step(): "at once" cannot mean "after a step"

    async def body(h: Harness) -> None:
        calls = [h.stub.Generate(text_request("q" * 30, max_tokens=30)) for _ in range(2)]
        await until(lambda: fake.stepped.is_set() and h.service.model.engine.num_in_flight == 2)
        code, details = await code_of(h.stub.Generate(text_request("late")))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "the bound is 2" in details
        fake.gate.set()
        for call in calls:
            call.cancel()

    run(body, fake, max_waiting=2)


def test_one_failure_does_not_disturb_another() -> None:
    fake = FakeEngine(step_delay_s=0.005)

    async def body(h: Harness) -> None:
        good = asyncio.ensure_future(h.stub.Generate(text_request("g" * 40, max_tokens=40)))
        doomed = h.stub.Stream(text_request("c" * 40, max_tokens=40))
        await doomed.read()
        doomed.cancel()
        await code_of(h.stub.Generate(text_request("hi", sampling=pb.SamplingParameters(temperature=-1))))
        await code_of(h.stub.Generate(text_request("d" * 40, max_tokens=40), timeout=0.05))
        response = await good
        assert response.choices[0].text == "g" * 40
        assert response.choices[0].finish_reason == pb.FINISH_REASON_LENGTH

    run(body, fake)


def test_engine_step_failure_is_internal_with_an_error_id() -> None:
    fake = FakeEngine()

    async def body(h: Harness) -> None:
        fake.fail_steps = 1
        code, details = await code_of(h.stub.Generate(text_request("boom")))
        assert code == grpc.StatusCode.INTERNAL and "error id" in details
        assert (await h.stub.Generate(text_request("fine"))).choices[0].text == "fine"

    run(body, fake)


def test_health_and_readiness_while_loading_then_ready() -> None:
    release = threading.Event()
    fake = FakeEngine()

    def slow_factory() -> FakeEngine:
        release.wait(10)
        return fake

    async def body(h: Harness) -> None:
        loading = asyncio.create_task(h.service.load())
        assert await h.readiness("") == health_pb2.HealthCheckResponse.SERVING
        assert await h.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING
        state = await h.stub.Health(pb.HealthRequest())
        assert (state.state, state.ready) == (pb.SERVING_STATE_LOADING, False)
        code, _ = await code_of(h.stub.Generate(text_request("hi")))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert not (await h.stub.ListModels(pb.ListModelsRequest())).models
        release.set()
        await loading
        assert await h.readiness() == health_pb2.HealthCheckResponse.SERVING
        state = await h.stub.Health(pb.HealthRequest())
        assert (state.state, state.ready, state.model, state.kv_blocks_total) == (
            pb.SERVING_STATE_READY, True, "fake-model", 100)
        [model] = (await h.stub.ListModels(pb.ListModelsRequest())).models
        assert (model.id, model.max_model_len) == ("fake-model", 128) and model.created > 0

    run(body, load=False, factory=slow_factory)


def test_what_loading_made_is_kept_out_of_the_collectors_full_passes() -> None:
    # A full collection walks every tracked object: the default model's ~190k made each one a
    # 70-220 ms stall with the GIL held, a few times a minute under load.
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    fake = FakeEngine()
    fake.loaded = [[i] for i in range(1000)]  # containers a real load leaves alive

    async def body(h: Harness) -> None:
        assert gc.get_freeze_count() >= 1000
        collectable = gc.get_objects(generation=0) + gc.get_objects(generation=1) + gc.get_objects(generation=2)
        assert not any(o is fake.loaded[0] for o in collectable)

    try:
        run(body, fake)
    finally:
        gc.unfreeze()


def test_health_reports_queue_depth_and_kv_usage() -> None:
    fake = FakeEngine(step_delay_s=0.02, max_running=1)

    async def body(h: Harness) -> None:
        calls = [h.stub.Generate(text_request("k" * 30, max_tokens=30)) for _ in range(3)]
        stats = h.service.model.engine.stats
        await until(lambda: (stats().num_running, stats().num_waiting) == (1, 2))
        state = await h.stub.Health(pb.HealthRequest())
        assert (state.num_running, state.num_waiting, state.kv_blocks_used) == (1, 2, 2)
        assert state.kv_cache_usage == pytest.approx(0.02)
        for call in calls:
            call.cancel()

    run(body, fake)


def test_reflection_lists_the_services() -> None:
    async def body(h: Harness) -> None:
        stub = reflection_pb2_grpc.ServerReflectionStub(h.channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = [r async for r in stub.ServerReflectionInfo(iter([request]))]
        names = {s.name for s in responses[0].list_services_response.service}
        assert {"forge.v1.Forge", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= names
        by_symbol = reflection_pb2.ServerReflectionRequest(file_containing_symbol="forge.v1.Forge")
        responses = [r async for r in stub.ServerReflectionInfo(iter([by_symbol]))]
        assert responses[0].file_descriptor_response.file_descriptor_proto

    run(body)


def test_drain_refuses_new_work_and_lets_in_flight_finish() -> None:
    fake = FakeEngine(step_delay_s=0.01)

    async def body(h: Harness) -> None:
        in_flight = asyncio.ensure_future(h.stub.Generate(text_request("f" * 30, max_tokens=30)))
        await until(lambda: h.service.in_flight == 1)
        drain = asyncio.create_task(h.service.drain(timeout_s=10))
        await until(lambda: h.service.phase is Phase.DRAINING)
        assert await h.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await h.readiness("") == health_pb2.HealthCheckResponse.SERVING
        code, _ = await code_of(h.stub.Generate(text_request("new")))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert (await in_flight).choices[0].text == "f" * 30
        assert await drain is True

    run(body, fake)


def test_drain_timeout_cancels_what_is_left() -> None:
    fake = FakeEngine(step_delay_s=0.02)

    async def body(h: Harness) -> None:
        call = h.stub.Generate(text_request("t" * 100, max_tokens=100, request_id="slow"))
        await until(lambda: h.service.in_flight == 1)
        assert await h.service.drain(timeout_s=0.1) is False
        await h.service.stop()
        code, _ = await code_of(call)
        assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
        assert [fake.labels[i] for i in fake.aborted] == ["slow"]

    run(body, fake)


def test_sigterm_drains_then_returns() -> None:
    fake = FakeEngine(step_delay_s=0.01)

    async def main() -> None:
        service = ForgeService(CONFIG, lambda: fake)
        port = await service.start()
        running = asyncio.create_task(service.run())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ForgeStub(channel)
            await until(lambda: service.phase is Phase.READY)
            in_flight = asyncio.ensure_future(stub.Generate(text_request("s" * 20, max_tokens=20)))
            await until(lambda: service.in_flight == 1)
            os.kill(os.getpid(), signal.SIGTERM)
            assert (await in_flight).choices[0].text == "s" * 20
            await asyncio.wait_for(running, 10)
        assert service.phase is Phase.DRAINING and not fake.aborted

    asyncio.run(main())
