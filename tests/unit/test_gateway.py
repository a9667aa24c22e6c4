"""The gateway over HTTP against a fake Forge gRPC servicer on a loopback port: OpenAI shapes
(httpx and the official `openai` client), error mapping, auth, health, client disconnects."""
from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator

import grpc
import httpx
import openai
import pytest
import uvicorn

from forge_gateway import convert, streams
from forge_gateway.app import create_app
from forge_gateway.config import GatewayConfig
from forge_gateway.errors import GatewayError, openai_param
from forge_gateway.models import CompletionRequest
from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc

pytestmark = pytest.mark.timeout(60)
S = grpc.StatusCode
ERRORS = {
    "queue-full": (S.RESOURCE_EXHAUSTED, "the waiting queue is full: 3 requests waiting, the bound is 3"),
    "too-large": (S.RESOURCE_EXHAUSTED, "Received message larger than max (70000000 vs. 67108864)"),
    "draining": (S.UNAVAILABLE, "the service is draining"),
    "bad-arg": (S.INVALID_ARGUMENT, "top_p must be in (0, 1], got 5.0"),
    "crash": (S.INTERNAL, "internal error [error id abc123]"),
    "too-slow": (S.DEADLINE_EXCEEDED, "the deadline passed before generation finished"),
    "too-long": (S.INVALID_ARGUMENT, "the prompt has 9031 tokens, but the model's context length is 8192"),
}
# Trailing metadata the service marks an error with (kind, field), by prompt.
MARKS = {"queue-full": (("forge-error-kind", "queue_full"),),
         "too-long": (("forge-error-kind", "context_length_exceeded"), ("forge-error-field", "chat")),
         "bad-arg": (("forge-error-field", "sampling.top_p"),)}


def prompt_of(request: pb.GenerateRequest) -> str:
    kind = request.WhichOneof("input")
    if kind == "chat":
        return request.chat.messages[-1].content
    if kind == "token_ids":
        return "ids:" + ",".join(map(str, request.token_ids.ids))
    return request.text


class FakeForge(pb_grpc.ForgeServicer):
    """Answers `echo <prompt> <i>` per choice, 3 characters per chunk, one token per byte."""

    def __init__(self) -> None:
        self.requests: list[pb.GenerateRequest] = []
        self.cancelled: list[str] = []
        self.ready = True

    def _admit(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> str:
        self.requests.append(request)
        if request.model == "missing":
            context.abort(S.NOT_FOUND, "model 'missing' is not served here; this server serves 'fake-model'")
        prompt = prompt_of(request)
        if prompt in MARKS:  # e.g. the service marks its one retryable RESOURCE_EXHAUSTED
            context.set_trailing_metadata(MARKS[prompt])
        if prompt in ERRORS:
            context.abort(*ERRORS[prompt])
        if prompt == "slow":
            self._record_cancellation(request, context)
        return prompt

    def _record_cancellation(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> None:
        """Put the request id in `cancelled` when the call ends before `_wait_for_cancel` gives up.

        A termination callback, not a check after the wait: a server that sees a stream cancelled while
        it sends a message stops iterating the handler, so code after the handler's `yield` may never run."""
        def ended() -> None:
            if not context.gave_up:  # type: ignore[attr-defined]
                self.cancelled.append(request.request_id)

        context.gave_up = False  # type: ignore[attr-defined]
        context.add_callback(ended)

    def _wait_for_cancel(self, context: grpc.ServicerContext) -> None:
        deadline = time.monotonic() + 10
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.01)
        context.gave_up = context.is_active()  # type: ignore[attr-defined]

    def _positions(self, request: pb.GenerateRequest, piece: str) -> list[pb.PositionLogprobs]:
        if not request.logprobs:
            return []
        alternatives = [pb.TokenLogprob(token_id=65 + k, token=chr(65 + k), logprob=-2.0 - k, bytes=bytes([65 + k]))
                        for k in range(request.top_logprobs)]
        return [pb.PositionLogprobs(chosen=pb.TokenLogprob(token_id=ord(c), token=c, logprob=-0.25, bytes=c.encode()),
                                    top=alternatives) for c in piece]

    def _finish(self, request: pb.GenerateRequest, message: Any) -> None:
        if request.stopping.stop:
            message.finish_reason, message.stop_string = pb.FINISH_REASON_STOP, request.stopping.stop[0]
        else:
            message.finish_reason = pb.FINISH_REASON_LENGTH

    @staticmethod
    def _thought(prompt: str, i: int) -> str:
        """A prompt beginning "think" gets a thought before each answer, as a service splitting
        reasoning returns it."""
        return f"thought {i} about {prompt}" if prompt.startswith("think") else ""

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.GenerateResponse:
        prompt = self._admit(request, context)
        if prompt == "slow":
            self._wait_for_cancel(context)
            return pb.GenerateResponse()
        response = pb.GenerateResponse(request_id=request.request_id, model="fake-model")
        for i in range(request.n or 1):
            text = f"echo {prompt} {i}"
            choice = response.choices.add(index=i, text=text, token_ids=text.encode(),
                                          logprobs=self._positions(request, text), reasoning=self._thought(prompt, i))
            self._finish(request, choice)
            response.usage.completion_tokens += len(text)
            response.usage.reasoning_tokens += len(choice.reasoning)
        response.usage.prompt_tokens, response.usage.cached_tokens = len(prompt), 2
        response.usage.draft_tokens, response.usage.accepted_draft_tokens = 7, 5
        return response

    def Stream(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.StreamResponse]:
        prompt = self._admit(request, context)
        for i in range(request.n or 1):
            text = f"echo {prompt} {i}"
            thought = self._thought(prompt, i)
            for at in range(0, len(thought), 4):  # the thought first, in its own chunks
                chunk = pb.StreamChunk(index=i, reasoning=thought[at:at + 4], token_ids=thought[at:at + 4].encode())
                yield pb.StreamResponse(request_id=request.request_id, chunk=chunk)
            for at in range(0, len(text), 3):
                piece = text[at:at + 3]
                chunk = pb.StreamChunk(index=i, text=piece, token_ids=piece.encode(),
                                       logprobs=self._positions(request, piece))
                yield pb.StreamResponse(request_id=request.request_id, chunk=chunk)
                if prompt == "slow":
                    self._wait_for_cancel(context)
                    return
                if prompt == "midstream-fail":
                    context.abort(S.INTERNAL, "internal engine error [error id def456]")
            final = pb.StreamFinal(index=i, usage=pb.Usage(prompt_tokens=len(prompt), completion_tokens=len(text),
                                                           cached_tokens=2, draft_tokens=3 + i,
                                                           accepted_draft_tokens=1 + i, reasoning_tokens=len(thought)))
            self._finish(request, final)
            yield pb.StreamResponse(request_id=request.request_id, final=final)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthResponse:
        state = pb.SERVING_STATE_READY if self.ready else pb.SERVING_STATE_LOADING
        return pb.HealthResponse(model="fake-model", state=state, ready=self.ready, num_waiting=1, num_running=2,
                                 kv_cache_usage=0.25, kv_blocks_used=25, kv_blocks_total=100)

    def Embed(self, request: pb.EmbedRequest, context: grpc.ServicerContext) -> pb.EmbedResponse:
        """Input i embeds as [i, its length, 0.5]; an input "bad" is INVALID_ARGUMENT naming it."""
        self.requests.append(request)
        response = pb.EmbedResponse(request_id=request.request_id, model="fake-model")
        for i, item in enumerate(request.inputs):
            if item.text == "bad":
                context.set_trailing_metadata((("forge-error-field", f"inputs[{i}]"),))
                context.abort(S.INVALID_ARGUMENT, f"inputs[{i}] is bad")
            length = len(item.text) if item.HasField("text") else len(item.token_ids.ids)
            response.embeddings.add(values=[float(i), float(length), 0.5], prompt_tokens=length)
            response.usage.prompt_tokens += length
        return response

    def Tokenize(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        ids = list(self._admit(request, context).encode())  # one token per byte
        return pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=2048)

    def Detokenize(self, request: pb.DetokenizeRequest, context: grpc.ServicerContext) -> pb.DetokenizeResponse:
        if any(t > 255 for t in request.token_ids):
            context.set_trailing_metadata((("forge-error-field", "token_ids"),))
            context.abort(S.INVALID_ARGUMENT, "token_ids has an id outside the vocabulary [0, 256)")
        return pb.DetokenizeResponse(text=bytes(request.token_ids).decode())

    def ListModels(self, request: pb.ListModelsRequest, context: grpc.ServicerContext) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[pb.ModelInfo(id="fake-model", max_model_len=2048, created=1700000000)])


class Gateway:
    """The app under uvicorn on a loopback port, on a background thread."""

    def __init__(self, config: GatewayConfig) -> None:
        self.server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "gateway did not start"
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[FakeForge, Gateway, Gateway, str]]:
    fake = FakeForge()
    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ForgeServicer_to_server(fake, server)
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    open_gateway = Gateway(GatewayConfig(target=target, retry_after_s=3))
    locked_gateway = Gateway(GatewayConfig(target=target, api_key="sekret"))
    yield fake, open_gateway, locked_gateway, target
    open_gateway.stop()
    locked_gateway.stop()
    server.stop(None)


@pytest.fixture
def fake(stack: tuple) -> FakeForge:
    stack[0].requests.clear()
    stack[0].ready = True
    return stack[0]


@pytest.fixture
def http(stack: tuple) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack[1].url, timeout=10) as client:
        yield client


@pytest.fixture
def client(stack: tuple) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack[1].url + "/v1", api_key="unused", max_retries=0)


def chat_body(content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], **fields}


def sse_events(response: httpx.Response, failed: bool = False) -> list[Any]:
    """The data of each event. A stream that `failed` ends with one `event: error` and no [DONE]."""
    lines = [line for line in response.iter_lines() if line]
    if failed:
        assert lines[-2] == "event: error" and "[DONE]" not in lines[-1]
        lines = lines[:-2] + [lines[-1], "data: [DONE]"]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


# ---- shapes --------------------------------------------------------------------------

def test_models(http: httpx.Client, client: openai.OpenAI, fake: FakeForge) -> None:
    body = http.get("/v1/models").json()
    assert body["object"] == "list"
    assert body["data"][0] == {"id": "fake-model", "object": "model", "created": 1700000000, "owned_by": "forge",
                               "root": "fake-model", "parent": None, "max_model_len": 2048}
    assert [m.id for m in client.models.list()] == ["fake-model"]
    assert http.get("/v1/models/fake-model").json() == body["data"][0]  # OpenAI's retrieve
    assert client.models.retrieve("fake-model").id == "fake-model"
    missing = http.get("/v1/models/org/other-model")
    assert missing.status_code == 404
    assert missing.json()["error"] == {"message": "model 'org/other-model' is not served here",
                                       "type": "invalid_request_error", "param": "model", "code": "model_not_found"}
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


def test_chat_completion_with_every_parameter(client: openai.OpenAI, fake: FakeForge) -> None:
    response = client.chat.completions.create(
        model="fake-model", n=2, seed=7, temperature=0.5, top_p=0.9, max_completion_tokens=40,
        presence_penalty=0.5, frequency_penalty=0.25, logit_bias={"65": 1.5}, stop=["\n"],
        logprobs=True, top_logprobs=2,
        messages=[{"role": "developer", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]}],
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True,
                    "num_speculative_tokens": 3},
        prediction={"type": "content", "content": [{"type": "text", "text": "echo "}, {"type": "text", "text": "hi"}]})
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    assert [c.message.content for c in response.choices] == ["echo hello 0", "echo hello 1"]
    assert response.choices[0].message.role == "assistant" and response.choices[0].finish_reason == "stop"
    token = response.choices[0].logprobs.content[0]
    assert (token.token, token.logprob, token.bytes) == ("e", -0.25, [101])
    assert [(t.token, t.logprob) for t in token.top_logprobs] == [("A", -2.0), ("B", -3.0)]
    assert (response.usage.prompt_tokens, response.usage.completion_tokens, response.usage.total_tokens) == (5, 24, 29)
    assert response.usage.prompt_tokens_details.cached_tokens == 2
    details = response.usage.completion_tokens_details  # speculative decoding's drafts, as OpenAI's predictions
    assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (5, 2)

    [sent] = fake.requests
    assert sent.num_speculative_tokens == 3 and sent.prediction == "echo hi"
    assert [(m.role, m.content) for m in sent.chat.messages] == [("system", "be brief"), ("user", "hello")]
    s, t = sent.sampling, sent.stopping
    assert (sent.n, s.seed, s.temperature, s.top_p, s.top_k, s.repetition_penalty) == (
        2, 7, 0.5, pytest.approx(0.9), 5, pytest.approx(1.2))
    assert (s.presence_penalty, s.frequency_penalty, dict(s.logit_bias)) == (0.5, 0.25, {65: 1.5})
    assert s.min_p == pytest.approx(0.1)
    assert (t.max_tokens, list(t.stop), t.ignore_eos, sent.logprobs, sent.top_logprobs) == (40, ["\n"], True, True, 2)


def test_chat_defaults_leave_optional_fields_unset(http: httpx.Client, fake: FakeForge) -> None:
    http.post("/v1/chat/completions", json=chat_body(max_tokens=9)).raise_for_status()
    [sent] = fake.requests
    assert not any(sent.sampling.HasField(name) for name in ("temperature", "top_p", "top_k", "min_p",
                                                              "repetition_penalty", "seed"))
    assert not sent.HasField("num_speculative_tokens") and sent.prediction == ""
    assert sent.stopping.max_tokens == 9 and sent.n == 1 and not sent.logprobs
    # A value the request gives is sent, even Forge's own default: the model's would take its place.
    http.post("/v1/chat/completions", json=chat_body(top_k=0, min_p=0.0, temperature=1.0)).raise_for_status()
    assert all(fake.requests[-1].sampling.HasField(name) for name in ("top_k", "min_p", "temperature"))


def test_chat_stream_shape_with_usage(http: httpx.Client, client: openai.OpenAI, fake: FakeForge) -> None:
    with http.stream("POST", "/v1/chat/completions",
                     json=chat_body(n=2, stream=True, stream_options={"include_usage": True})) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert all(e["object"] == "chat.completion.chunk" and e["id"] == events[0]["id"] for e in events)
    assert [e["choices"][0]["delta"] for e in events[:2]] == [{"role": "assistant", "content": ""}] * 2
    assert all(e["usage"] is None for e in events[:-1])
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 18
    assert events[-1]["usage"]["completion_tokens_details"] == {"accepted_prediction_tokens": 3,
                                                                 "rejected_prediction_tokens": 4, "reasoning_tokens": 0}
    texts = {0: "", 1: ""}
    for event in events[2:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
    assert texts == {0: "echo hi 0", 1: "echo hi 1"}
    finals = [c for e in events for c in e["choices"] if c["finish_reason"]]
    assert [(c["index"], c["finish_reason"], c["delta"]) for c in finals] == [(0, "length", {}), (1, "length", {})]

    chunks = list(client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "yo"}],
                                                 stream=True, logprobs=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo yo 0"
    assert chunks[1].choices[0].logprobs.content[0].token == "e"


def test_completions_legacy_logprobs_and_default_max_tokens(client: openai.OpenAI, fake: FakeForge) -> None:
    response = client.completions.create(model="fake-model", prompt="abc", logprobs=1)
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    choice = response.choices[0]
    assert choice.text == "echo abc 0" and choice.finish_reason == "length"
    assert choice.logprobs.tokens[:3] == ["e", "c", "h"] and choice.logprobs.text_offset[:3] == [0, 1, 2]
    assert choice.logprobs.top_logprobs[0] == {"A": -2.0, "e": -0.25}
    assert fake.requests[0].stopping.max_tokens == 16  # OpenAI's default for completions
    assert (fake.requests[0].logprobs, fake.requests[0].top_logprobs) == (True, 1)


def test_completions_batch_of_prompts_and_token_ids(client: openai.OpenAI, fake: FakeForge) -> None:
    response = client.completions.create(model="fake-model", prompt=["a", "b"], n=2, max_tokens=5)
    assert [(c.index, c.text) for c in response.choices] == [
        (0, "echo a 0"), (1, "echo a 1"), (2, "echo b 0"), (3, "echo b 1")]
    assert response.usage.prompt_tokens == 2
    response = client.completions.create(model="fake-model", prompt=[1, 2, 3])
    assert response.choices[0].text == "echo ids:1,2,3 0"


def test_completions_stream(http: httpx.Client, client: openai.OpenAI, fake: FakeForge) -> None:
    chunks = list(client.completions.create(model="fake-model", prompt=["p", "q"], stream=True, logprobs=0))
    texts: dict[int, str] = {}
    for chunk in chunks:
        assert chunk.object == "text_completion"
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {0: "echo p 0", 1: "echo q 0"}
    with_logprobs = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert sum(len(lp.tokens) for lp in with_logprobs) == 16
    with http.stream("POST", "/v1/completions", json={"model": "m", "prompt": "x", "stream": True,
                                                       "stop": "!"}) as response:
        events = sse_events(response)
    assert events[-1]["choices"][0]["finish_reason"] == "stop" and events[-1]["choices"][0]["stop_reason"] == "!"


def test_request_id_header_reaches_the_service(http: httpx.Client, fake: FakeForge) -> None:
    body = http.post("/v1/chat/completions", json=chat_body(), headers={"X-Request-Id": "abc-1"}).json()
    assert body["id"] == "chatcmpl-abc-1" and fake.requests[0].request_id == "abc-1"


# ---- errors --------------------------------------------------------------------------

@pytest.mark.parametrize("prompt, status, code, param", [
    ("queue-full", 429, "queue_full", None), ("too-large", 413, "request_too_large", None),
    ("draining", 503, "unavailable", None), ("bad-arg", 400, None, "top_p"),
    ("too-long", 400, "context_length_exceeded", "messages"),
    ("crash", 500, None, None), ("too-slow", 504, "deadline_exceeded", None)])
@pytest.mark.parametrize("stream", [False, True])
def test_grpc_status_maps_to_http(http: httpx.Client, fake: FakeForge, prompt: str, status: int,
                                  code: str | None, param: str | None, stream: bool) -> None:
    response = http.post("/v1/chat/completions", json=chat_body(prompt, stream=stream))
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and (error["code"], error["param"]) == (code, param)
    assert error["message"] == ERRORS[prompt][1]
    if status in (429, 503):
        assert response.headers["retry-after"] == "3"


def test_unknown_model_is_404(http: httpx.Client, client: openai.OpenAI, fake: FakeForge) -> None:
    response = http.post("/v1/completions", json={"model": "missing", "prompt": "x"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])


def test_openai_client_sees_typed_errors(client: openai.OpenAI, fake: FakeForge) -> None:
    def ask(prompt: str) -> Any:
        return client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": prompt}])

    with pytest.raises(openai.RateLimitError):
        ask("queue-full")
    with pytest.raises(openai.BadRequestError, match="top_p"):
        ask("bad-arg")
    with pytest.raises(openai.InternalServerError, match="error id"):
        ask("crash")
    with pytest.raises(openai.APIStatusError) as info:
        ask("draining")
    assert info.value.status_code == 503


@pytest.mark.parametrize("body, param", [
    ({"model": "m"}, "messages"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages.0.content"),
    ({"model": "m", "messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]},
     "messages.0.content"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}, "messages.1"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, None),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "num_speculative_tokens": 65},
     "num_speculative_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "prediction": {"type": "text", "content": "y"}},
     "prediction.type"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "prediction": {"type": "content"}},
     "prediction.content"),
])
def test_validation_errors_are_400(http: httpx.Client, fake: FakeForge, body: dict, param: str | None) -> None:
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert not fake.requests  # never reached the service


@pytest.mark.parametrize("logprobs", [21, -1])
def test_a_completion_s_logprobs_out_of_range_are_400_naming_logprobs(http: httpx.Client, fake: FakeForge,
                                                                      logprobs: int) -> None:
    for echo in (False, True):  # echo asks the service for the prompt's logprobs with the same bound
        response = http.post("/v1/completions", json={"model": "m", "prompt": "x", "logprobs": logprobs, "echo": echo})
        assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"
    assert not fake.requests


def test_a_validator_error_reads_as_its_own_message(http: httpx.Client) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}
    assert http.post("/v1/chat/completions", json=body).json()["error"]["message"] == "top_logprobs needs logprobs: true"


def test_malformed_json_and_unknown_route(http: httpx.Client) -> None:
    response = http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    response = http.get("/v1/nothing")
    assert response.status_code == 404
    assert response.json()["error"] == {"message": "invalid URL (GET /v1/nothing): no such route",
                                        "type": "invalid_request_error", "param": None, "code": None}
    response = http.post("/chat/completions", json={})  # a base URL without /v1
    assert response.status_code == 404 and response.json()["error"]["message"] == (
        "invalid URL (POST /chat/completions): no such route; the OpenAI API is served under /v1 (/v1/chat/completions)")
    assert http.get("/v2/models").json()["error"]["message"] == "invalid URL (GET /v2/models): no such route"
    response = http.get("/v1/chat/completions")  # RFC 9110: a 405 names the methods that the route takes
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["message"] == "method not allowed (GET /v1/chat/completions); this route takes POST"


def test_error_after_the_stream_started_is_an_sse_event(http: httpx.Client, client: openai.OpenAI,
                                                        fake: FakeForge) -> None:
    with http.stream("POST", "/v1/chat/completions", json=chat_body("midstream-fail", stream=True)) as response:
        events = sse_events(response, failed=True)
    assert events[-1]["error"]["message"] == "internal engine error [error id def456]"
    with pytest.raises(openai.APIError):
        list(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "midstream-fail"}],
                                            stream=True))


def test_api_key(stack: tuple, fake: FakeForge) -> None:
    url = stack[2].url
    assert httpx.get(url + "/v1/models").status_code == 401
    wrong = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
    assert httpx.get(url + "/health").status_code == 200  # probes need no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    assert openai.OpenAI(base_url=url + "/v1", api_key="sekret").models.list().data[0].id == "fake-model"


def test_health(http: httpx.Client, fake: FakeForge) -> None:
    response = http.get("/health")
    assert response.status_code == 200
    assert response.json() == {"status": "ready", "model": "fake-model", "num_waiting": 1, "num_running": 2,
                               "kv_cache_usage": 0.25, "kv_blocks_used": 25, "kv_blocks_total": 100}
    fake.ready = False
    response = http.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "loading"


def test_health_when_the_service_is_unreachable() -> None:
    async def main() -> httpx.Response:
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
            app = create_app(GatewayConfig(), channel=channel)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                return await c.get("/health")

    response = asyncio.run(main())
    assert response.status_code == 503 and response.json()["status"] == "unavailable"


# ---- disconnects and bugs ------------------------------------------------------------

def _until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_disconnected_stream_client_cancels_the_grpc_call(stack: tuple, fake: FakeForge) -> None:
    with httpx.Client(base_url=stack[1].url) as http:
        with http.stream("POST", "/v1/chat/completions", json=chat_body("slow", stream=True),
                         headers={"X-Request-Id": "gone-stream"}) as response:
            next(response.iter_lines())
    _until(lambda: "gone-stream" in fake.cancelled)


def test_disconnected_client_cancels_the_unary_grpc_call(stack: tuple, fake: FakeForge) -> None:
    with httpx.Client(base_url=stack[1].url, timeout=0.3) as http, pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={"model": "m", "prompt": "slow"}, headers={"X-Request-Id": "gone"})
    _until(lambda: "gone" in fake.cancelled)


def test_gateway_bug_is_500_with_a_logged_id(stack: tuple, monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    def broken(*args: Any) -> Any:
        raise RuntimeError("boom")

    monkeypatch.setattr(convert, "chat_completion", broken)

    async def main() -> httpx.Response:
        async with grpc.aio.insecure_channel(stack[3]) as channel:
            app = create_app(GatewayConfig(), channel=channel)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                return await c.post("/v1/chat/completions", json=chat_body())

    with caplog.at_level(logging.ERROR, logger="forge_gateway.errors"):
        response = asyncio.run(main())
    assert response.status_code == 500
    message = response.json()["error"]["message"]
    error_id = message.split("error id ")[1].rstrip("]")
    assert any(error_id in record.getMessage() and record.exc_info for record in caplog.records)


@pytest.mark.parametrize("field, param", [
    ("stopping.max_tokens", "max_tokens"), ("sampling.logit_bias", "logit_bias"), ("stopping.stop[1]", "stop[1]"),
    ("chat", "messages"), ("chat.messages[2].content", "messages[2].content"), ("text", "prompt"),
    ("token_ids", "prompt"), ("json_schema", "response_format"), ("json_object", "response_format"),
    ("regex", "guided_regex"), ("choice", "guided_choice"), ("grammar", "guided_grammar"), ("tools", "tools"),
    ("tool_choice", "tool_choice"), ("n", "n"), ("top_logprobs", "top_logprobs"), ("", None), (None, None)])
def test_a_request_field_maps_to_the_openai_parameter_it_came_from(field: str | None, param: str | None) -> None:
    assert openai_param(field) == param


def test_tokenize_and_detokenize(http: httpx.Client, fake: FakeForge) -> None:
    """vLLM's /tokenize (a prompt or chat messages, counted by the service's Tokenize) and /detokenize."""
    counted = http.post("/tokenize", json={"model": "fake-model", "prompt": "hello"}).json()
    assert counted == {"count": 5, "max_model_len": 2048, "tokens": list(b"hello")}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    chat = http.post("/tokenize", json={"model": "fake-model", "messages": [{"role": "user", "content": "hi"}],
                                        "tools": [tool]})
    assert chat.json()["count"] == 2
    text, messages = fake.requests
    assert text.text == "hello" and [(m.role, m.content) for m in messages.chat.messages] == [("user", "hi")]
    assert [t.name for t in messages.tools] == ["f"]  # tools are in the prompt the count is of
    assert http.post("/detokenize", json={"model": "fake-model", "tokens": list(b"hey")}).json() == {"prompt": "hey"}
    bad = http.post("/detokenize", json={"model": "fake-model", "tokens": [300]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    for body in ({"model": "m"}, {"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}]},
                 {"model": "m", "prompt": "x", "add_special_tokens": False},
                 {"model": "m", "prompt": "x", "tools": [tool]}):
        assert http.post("/tokenize", json=body).status_code == 400, body
    for body in ({"model": "m", "prompt": []}, {"model": "m", "messages": []}):  # refused as the generation routes do
        refused = http.post("/tokenize", json=body)
        assert refused.status_code == 400 and refused.json()["error"]["type"] == "invalid_request_error", body


def _completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", **fields})


def _scored(token: str, raw: bytes, logprob: float) -> pb.PositionLogprobs:
    return pb.PositionLogprobs(chosen=pb.TokenLogprob(token=token, bytes=raw, logprob=logprob),
                               top=[pb.TokenLogprob(token="x", logprob=-0.1)])


def test_echo_decodes_a_token_prompt_whole_and_counts_offsets_on_into_the_completion() -> None:
    # "é" split over two byte tokens, as byte-level vocabularies do: each shows U+FFFD alone.
    prompt = pb.PromptLogprobs(first=pb.TokenLogprob(token="a", bytes=b"a"),
                               positions=[_scored("\ufffd", b"\xc3", -1.5), _scored("\ufffd", b"\xa9", -0.5)])
    answer = pb.GenerateResponse(prompt_logprobs=prompt, choices=[pb.Choice(
        text="!", logprobs=[_scored("!", b"!", -2.0)], finish_reason=pb.FINISH_REASON_LENGTH)])
    for echo in ([97, 195, 169], "a\u00e9"):
        body = convert.text_completion([answer], "id", 0, _completion(prompt=echo, echo=True, logprobs=1))
        [choice] = body["choices"]
        assert choice["text"] == "a\u00e9!"
        lp = choice["logprobs"]
        assert lp["tokens"] == ["a", "\ufffd", "\ufffd", "!"]
        assert lp["token_logprobs"] == [None, -1.5, -0.5, -2.0]
        assert lp["top_logprobs"][0] is None and lp["top_logprobs"][1] == {"x": pytest.approx(-0.1), "\ufffd": -1.5}
        assert lp["text_offset"] == [0, 1, 2, 3]
    stream = streams.CompletionStream("id", 0, "m", 2, False, False, echo=[[97, 195, 169]])
    events = stream.on_message(0, pb.StreamResponse(prompt_logprobs=prompt))
    assert [(e["choices"][0]["index"], e["choices"][0]["text"]) for e in events] == [(0, "a\u00e9"), (1, "a\u00e9")]
    assert streams.ChatStream("id", 0, "m", 1, False, False).on_message(
        0, pb.StreamResponse(prompt_logprobs=prompt)) == []  # asked for by completions' echo alone


def test_echo_without_the_prompt_s_logprobs_is_a_server_error_not_a_completion_missing_its_prompt() -> None:
    answer = pb.GenerateResponse(choices=[pb.Choice(text="!", finish_reason=pb.FINISH_REASON_LENGTH)])
    with pytest.raises(GatewayError) as whole:  # a service older than echo leaves them out
        convert.text_completion([answer], "id", 0, _completion(prompt="a", echo=True))
    stream = streams.CompletionStream("id", 0, "m", 1, False, False, echo=["a"])
    with pytest.raises(GatewayError) as streamed:
        stream.on_message(0, pb.StreamResponse(final=pb.StreamFinal(finish_reason=pb.FINISH_REASON_LENGTH)))
    assert whole.value.status == streamed.value.status == 500


def test_max_tokens_0_needs_echo(http: httpx.Client, fake: FakeForge) -> None:
    response = http.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 0})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    assert not fake.requests


def test_a_prompt_alone_is_its_echo_with_no_completion_tokens_billed() -> None:
    prompt = pb.PromptLogprobs(first=pb.TokenLogprob(token="a", bytes=b"a"), positions=[_scored("b", b"b", -1.0)])
    answer = pb.GenerateResponse(prompt_logprobs=prompt, usage=pb.Usage(prompt_tokens=2, completion_tokens=1),
                                 choices=[pb.Choice(text="!", finish_reason=pb.FINISH_REASON_STOP,
                                                    logprobs=[_scored("!", b"!", -2.0)])])
    body = convert.text_completion([answer], "id", 0, _completion(prompt="ab", echo=True, logprobs=0, max_tokens=0))
    [choice] = body["choices"]
    assert (choice["text"], choice["finish_reason"]) == ("ab", "length")
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0]
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (2, 0)
    stream = streams.CompletionStream("id", 0, "m", 1, False, True, echo=["ab"], prompt_only=True)
    events = stream.on_message(0, pb.StreamResponse(prompt_logprobs=prompt))
    events += stream.on_message(0, pb.StreamResponse(chunk=pb.StreamChunk(text="!", token_ids=[5])))
    events += stream.on_message(0, pb.StreamResponse(final=pb.StreamFinal(
        finish_reason=pb.FINISH_REASON_STOP, usage=pb.Usage(prompt_tokens=2, completion_tokens=1))))
    events += stream.end()
    assert [e["choices"][0]["text"] for e in events if e["choices"]] == ["ab", ""]
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert (events[-1]["usage"]["prompt_tokens"], events[-1]["usage"]["completion_tokens"]) == (2, 0)


def test_continuous_usage_counts_every_prompt_and_token_so_far() -> None:
    def chunk(index: int, ids: list[int], prompt_tokens: int) -> pb.StreamResponse:
        return pb.StreamResponse(chunk=pb.StreamChunk(index=index, text="x" * len(ids), token_ids=ids,
                                                      prompt_tokens=prompt_tokens))

    def final(prompt_tokens: int, completion_tokens: int) -> pb.StreamResponse:
        return pb.StreamResponse(final=pb.StreamFinal(finish_reason=pb.FINISH_REASON_LENGTH, usage=pb.Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)))

    # Two prompts of 5 and 7 tokens, their streams interleaved as the gateway merges them.
    stream = streams.CompletionStream("id", 0, "m", 1, False, True, True)
    events = stream.start(chunk(0, [1], 5)) + stream.on_message(0, chunk(0, [1], 5))
    events += stream.on_message(1, chunk(0, [2, 3], 7)) + stream.on_message(0, chunk(0, [4], 5))
    events += stream.on_message(0, final(5, 2)) + stream.on_message(1, final(7, 2)) + stream.end()
    assert [(e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"]) for e in events] == [
        (5, 1), (12, 3), (12, 4), (12, 4), (12, 4), (12, 4)]
    assert events[-1]["usage"]["total_tokens"] == 16 and events[-1]["choices"] == []
    # Not without include_usage, as vLLM has it; and a prompt alone bills no completion token.
    quiet = streams.ChatStream("id", 0, "m", 1, False, False, True)
    assert all("usage" not in e for e in quiet.start(chunk(0, [1], 5)) + quiet.on_message(0, chunk(0, [1], 5)))
    prompt = pb.PromptLogprobs(first=pb.TokenLogprob(token="a", bytes=b"a"), positions=[_scored("b", b"b", -1.0)])
    alone = streams.CompletionStream("id", 0, "m", 1, False, True, True, echo=["ab"], prompt_only=True)
    events = alone.on_message(0, pb.StreamResponse(prompt_logprobs=prompt)) + alone.on_message(0, chunk(0, [5], 2))
    events += alone.on_message(0, final(2, 1)) + alone.end()
    assert [(e["usage"]["prompt_tokens"], e["usage"]["completion_tokens"]) for e in events] == [(2, 0)] * 3


def test_vllm_prompt_logprobs_come_per_choice_or_once_for_chat_and_are_not_streamed(
        http: httpx.Client, fake: FakeForge) -> None:
    prompt = pb.PromptLogprobs(first=pb.TokenLogprob(token_id=7, token="a"), positions=[pb.PositionLogprobs(
        chosen=pb.TokenLogprob(token_id=8, token="b", logprob=-1.0, rank=3),
        top=[pb.TokenLogprob(token_id=9, token="c", logprob=-0.2), pb.TokenLogprob(token_id=10, token="d", logprob=-0.9)])])
    answer = pb.GenerateResponse(prompt_logprobs=prompt, choices=[pb.Choice(
        index=i, text="!", finish_reason=pb.FINISH_REASON_LENGTH, logprobs=[_scored("!", b"!", -2.0)]) for i in range(2)])
    expected = [None, {"8": {"logprob": -1.0, "rank": 3, "decoded_token": "b"},
                       "9": {"logprob": pytest.approx(-0.2), "rank": 1, "decoded_token": "c"}}]
    body = convert.text_completion([answer], "id", 0, _completion(prompt="ab", n=2, prompt_logprobs=1, echo=True,
                                                                   logprobs=0))
    assert [c["prompt_logprobs"] for c in body["choices"]] == [expected, expected]
    assert body["choices"][0]["logprobs"]["top_logprobs"][1] == {"b": -1.0}  # echo keeps to logprobs=0
    chat = convert.chat_completion(answer, "id", 0, "m", False, prompt_logprobs=1)
    assert chat["prompt_logprobs"] == expected and "prompt_logprobs" not in chat["choices"][0]
    assert "prompt_logprobs" not in convert.chat_completion(answer, "id", 0, "m", False)

    request = convert.completion_requests(_completion(prompt="ab", prompt_logprobs=2, echo=True, logprobs=5), "r")[0]
    assert request.prompt_logprobs == 5  # the larger of the two asks
    for path, body in (("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions",
                                                                {"messages": [{"role": "user", "content": "x"}]})):
        response = http.post(path, json={"model": "m", **body, "prompt_logprobs": 1, "stream": True})
        assert response.status_code == 400 and response.json()["error"]["param"] == "prompt_logprobs"
    assert not fake.requests
