"""The typed gRPC contract (forge.v1 stubs) against a real server on the default model."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from forge_service import SamplingParams
from forge_service.config import SchedulerConfig
from forge_service.pb import forge_pb2 as pb
from tests.integration.serving.servers import ForgeProcess, torch_threads

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_TOKENS = 16
CHAT = [{"role": "user", "content": "What is the capital of Japan?"}]
TEXT = "The three primary colors are"
# Long enough that nothing here finishes on its own while a test watches it.
ENDLESS = pb.StoppingParameters(max_tokens=4000, ignore_eos=True)


def greedy_request(**input_: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(**input_, sampling=pb.SamplingParameters(temperature=0.0),
                              stopping=pb.StoppingParameters(max_tokens=MAX_TOKENS))


def chat_input(messages: list[dict[str, str]]) -> pb.ChatInput:
    return pb.ChatInput(messages=[pb.ChatMessage(**m) for m in messages])


def collect_stream(call) -> tuple[str, list[int], list[pb.StreamFinal]]:
    text, ids, finals = "", [], []
    for message in call:
        if message.HasField("chunk"):
            text += message.chunk.text
            ids += message.chunk.token_ids
        else:
            finals.append(message.final)
    return text, ids, finals


def test_generate_and_stream_equal_the_offline_api_at_temperature_0(idle_server: ForgeProcess, llm_fp32) -> None:
    stub = idle_server.stub
    requests = [greedy_request(chat=chat_input(CHAT)), greedy_request(text=TEXT)]
    with ThreadPoolExecutor(4) as pool:  # all four calls in flight at once
        unary = [pool.submit(stub.Generate, r, timeout=120) for r in requests]
        streamed = [pool.submit(lambda r: collect_stream(stub.Stream(r, timeout=120)), r) for r in requests]
        with torch_threads(1):
            params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
            offline = [llm_fp32.chat(CHAT, params)[0], llm_fp32.generate(TEXT, params)[0]]
        for want, generated, stream in zip(offline, unary, streamed):
            expected = want.outputs[0]
            response = generated.result()
            [choice] = response.choices
            assert (choice.text, list(choice.token_ids)) == (expected.text, expected.token_ids)
            assert choice.finish_reason == pb.FinishReason.Value(f"FINISH_REASON_{expected.finish_reason.upper()}")
            assert response.usage.prompt_tokens == len(want.prompt_token_ids)
            assert response.usage.completion_tokens == len(expected.token_ids)
            assert response.model == idle_server.health().model
            text, ids, [final] = stream.result()
            assert (text, ids) == (expected.text, expected.token_ids)
            assert final.finish_reason == choice.finish_reason
            assert final.usage.completion_tokens == len(expected.token_ids)


def test_health_grpc_health_v1_and_reflection(forge_server: ForgeProcess) -> None:
    health = forge_server.health()
    assert health.ready and health.state == pb.SERVING_STATE_READY
    assert health.model == "SmolLM2-135M-Instruct.Q4_1"
    assert health.kv_blocks_total > 0 and 0.0 <= health.kv_cache_usage <= 1.0
    assert health.max_waiting == SchedulerConfig().max_waiting  # the default bound, passed through
    [model] = forge_server.stub.ListModels(pb.ListModelsRequest(), timeout=10).models
    assert (model.id, model.max_model_len) == (health.model, 8192)

    checker = health_pb2_grpc.HealthStub(forge_server.channel)
    for service in ("", "forge.v1.Forge"):
        answer = checker.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
    with pytest.raises(grpc.RpcError) as unknown:
        checker.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10)
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    reflection = ProtoReflectionDescriptorDatabase(forge_server.channel)
    services = set(reflection.get_services())
    assert {"forge.v1.Forge", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    forge_file = reflection.FindFileContainingSymbol("forge.v1.Forge")
    assert [m.name for m in forge_file.service[0].method] == ["Generate", "Stream", "Health", "ListModels", "Tokenize",
                                                             "Detokenize", "Embed"]


def test_cancelled_stream_frees_its_kv_blocks(idle_server: ForgeProcess) -> None:
    request = pb.GenerateRequest(chat=chat_input(CHAT), stopping=ENDLESS)
    call = idle_server.stub.Stream(request, timeout=120)
    chunks = [next(call) for _ in range(3)]
    assert all(c.HasField("chunk") for c in chunks)
    busy = idle_server.health()
    assert busy.num_running == 1 and busy.kv_blocks_used > 0
    call.cancel()
    with pytest.raises(grpc.RpcError) as cancelled:
        next(call)
    assert cancelled.value.code() == grpc.StatusCode.CANCELLED
    idle_server.wait_idle(timeout_s=10)


@pytest.mark.parametrize("rpc", ["Generate", "Stream"])
def test_deadline_on_a_long_generation_is_deadline_exceeded_and_frees_blocks(idle_server: ForgeProcess,
                                                                              rpc: str) -> None:
    request = pb.GenerateRequest(text=TEXT, stopping=ENDLESS)
    seen_running = []
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        if rpc == "Generate":
            outcome = pool.submit(idle_server.stub.Generate, request, timeout=1.0)
        else:
            outcome = pool.submit(lambda: collect_stream(idle_server.stub.Stream(request, timeout=1.0)))
        while not outcome.done():
            health = idle_server.health()
            seen_running.append(health.num_running == 1 and health.kv_blocks_used > 0)
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as expired:
            outcome.result()
    assert expired.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 5
    assert any(seen_running), "the request never ran, so its deadline proved nothing"
    idle_server.wait_idle(timeout_s=10)


@pytest.mark.parametrize(("request_fields", "code", "words"), [
    ({"model": "no-such-model"}, grpc.StatusCode.NOT_FOUND, "no-such-model"),
    ({"sampling": pb.SamplingParameters(temperature=-1.0)}, grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
    ({"stopping": pb.StoppingParameters(max_tokens=9000)}, grpc.StatusCode.INVALID_ARGUMENT, "8192"),
])
def test_bad_requests_get_typed_status_codes(forge_server: ForgeProcess, request_fields: dict, code, words) -> None:
    with pytest.raises(grpc.RpcError) as error:
        forge_server.stub.Generate(pb.GenerateRequest(text=TEXT, **request_fields), timeout=10)
    assert error.value.code() == code
    assert words in error.value.details()


def test_prompt_logprobs_come_once_before_the_tokens_and_equal_the_offline_api(idle_server: ForgeProcess,
                                                                              llm_fp32) -> None:
    ids = llm_fp32.tokenizer.encode(TEXT)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), prompt_logprobs=2, n=2,
                                 sampling=pb.SamplingParameters(temperature=0.0),
                                 stopping=pb.StoppingParameters(max_tokens=3))
    response = idle_server.stub.Generate(request, timeout=120)
    request.n = 1
    streamed = list(idle_server.stub.Stream(request, timeout=120))
    with torch_threads(1):
        [expected] = llm_fp32.generate([ids], SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2))
    prompt = response.prompt_logprobs
    assert (prompt.first.token_id, prompt.first.token) == (ids[0], llm_fp32.tokenizer.decode(ids[:1]))
    assert [p.chosen.token_id for p in prompt.positions] == ids[1:]
    assert [p.chosen.logprob for p in prompt.positions] == pytest.approx(
        [entry[0].logprob for entry in expected.prompt_logprobs[1:]], abs=1e-4)
    assert [[t.token_id for t in p.top] for p in prompt.positions] == \
        [[t.token_id for t in entry[1:]] for entry in expected.prompt_logprobs[1:]]
    assert len(response.choices) == 2  # and the prompt's logprobs once
    assert streamed[0].WhichOneof("event") == "prompt_logprobs"  # first, once
    assert [m.WhichOneof("event") for m in streamed].count("prompt_logprobs") == 1
    assert streamed[0].prompt_logprobs == prompt
    # A scored prompt is computed whole, though the Generate call before left it cached.
    assert [m.final.usage.cached_tokens for m in streamed if m.HasField("final")] == [0]

    with pytest.raises(grpc.RpcError) as bad:
        idle_server.stub.Generate(pb.GenerateRequest(text=TEXT, prompt_logprobs=21), timeout=60)
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(bad.value.trailing_metadata())["forge-error-field"] == "prompt_logprobs"
