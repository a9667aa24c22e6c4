"""The gateway's bounds on one request, against a fake Forge gRPC servicer on a loopback port:
the API key before any parsing, the body bound (413 before the body is read), hostile JSON (400),
size limits from GatewayConfig, the RESOURCE_EXHAUSTED mapping and finish reasons."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator
from urllib.parse import urlparse

import grpc
import httpx
import openai
import pytest

from forge_gateway import convert, limits
from forge_gateway.app import create_app
from forge_gateway.config import GatewayConfig
from forge_gateway.errors import GatewayError
from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc
from tests.unit.test_gateway import FakeForge, Gateway, chat_body, prompt_of, sse_events

pytestmark = pytest.mark.timeout(60)
KEY = "sekret"
LIMITS = GatewayConfig(max_body_bytes=64 << 10, max_json_depth=16, max_unknown_field_bytes=1024, max_prompts=4,
                       max_messages=8, max_stop=2, max_stop_chars=5, max_n=4, max_n_tokens=100, max_logit_bias=3)
OPENAI_FINISH_REASONS = {"stop", "length", "content_filter", "tool_calls", "function_call"}


class LimitsFake(FakeForge):
    """FakeForge (where `too-large` fails like a message over gRPC's size limit: RESOURCE_EXHAUSTED with no
    queue mark), and: `aborted` / `unfinished` end choice 0 with FINISH_REASON_ABORT / _UNSPECIFIED."""

    def _finish(self, request: pb.GenerateRequest, message: Any) -> None:
        ends = {"aborted": pb.FINISH_REASON_ABORT, "unfinished": pb.FINISH_REASON_UNSPECIFIED}
        super()._finish(request, message)
        if prompt_of(request) in ends:
            message.finish_reason = ends[prompt_of(request)]


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[LimitsFake, Gateway, Gateway]]:
    fake = LimitsFake()
    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ForgeServicer_to_server(fake, server)
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    small = Gateway(dataclasses.replace(LIMITS, target=target, retry_after_s=3))
    locked = Gateway(GatewayConfig(target=target, api_key=KEY))
    yield fake, small, locked
    small.stop()
    locked.stop()
    server.stop(None)


@pytest.fixture
def fake(stack: tuple) -> LimitsFake:
    stack[0].requests.clear()
    return stack[0]


@pytest.fixture
def http(stack: tuple) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack[1].url, timeout=10) as client:
        yield client


@pytest.fixture
def locked(stack: tuple) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack[2].url, timeout=10) as client:
        yield client


def raw_post(url: str, path: str, declared_length: int, sent: bytes, headers: str = "") -> tuple[int, dict, float]:
    """POST with a Content-Length of `declared_length` but only `sent` bytes of body; (status, JSON, seconds)."""
    host, port = urlparse(url).hostname, urlparse(url).port
    start = time.monotonic()
    with socket.create_connection((host, port), timeout=5) as sock:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {declared_length}\r\n{headers}\r\n")
        sock.sendall(head.encode() + sent)
        received = b""
        while b"\r\n\r\n" not in received or not _complete(received):
            data = sock.recv(65536)
            if not data:
                break
            received += data
    elapsed = time.monotonic() - start
    head, _, body = received.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body), elapsed


def _complete(received: bytes) -> bool:
    head, _, body = received.partition(b"\r\n\r\n")
    length = [line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:")]
    return bool(length) and len(body) >= int(length[0].split(b":")[1])


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


# ---- body size -----------------------------------------------------------------------

def test_declared_oversized_body_is_413_before_it_is_read(stack: tuple, fake: LimitsFake) -> None:
    status, body, elapsed = raw_post(stack[1].url, "/v1/chat/completions", 70 << 20, b'{"model": "m", ')
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert "65536 bytes" in body["error"]["message"]
    assert elapsed < 2.0 and not fake.requests


def test_streamed_body_is_refused_as_soon_as_it_passes_the_bound() -> None:
    """No Content-Length (chunked): reading stops at the first chunk past the bound."""
    chunk, consumed = b" " * 10_000, []

    async def receive() -> dict:
        consumed.append(1)
        return {"type": "http.request", "body": chunk, "more_body": True}  # endless

    async def main() -> list[dict]:
        sent: list[dict] = []

        async def send(message: dict) -> None:
            sent.append(message)

        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
            app = create_app(GatewayConfig(max_body_bytes=50_000), channel=channel)
            scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                     "scheme": "http", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                     "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
                     "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}
            await asyncio.wait_for(app(scope, receive, send), 5)
        return sent

    sent = asyncio.run(main())
    assert sent[0]["status"] == 413 and (b"connection", b"close") in sent[0]["headers"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
    assert len(consumed) == 6  # 5 chunks fit in 50,000 bytes; the 6th passes the bound


def test_openai_client_gets_413_and_does_not_retry(stack: tuple, fake: LimitsFake) -> None:
    client = openai.OpenAI(base_url=stack[1].url + "/v1", api_key="unused", max_retries=2)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x" * (100 << 10)}])
    assert info.value.status_code == 413 and not isinstance(info.value, openai.RateLimitError)
    assert not fake.requests


# ---- authentication first ------------------------------------------------------------

def test_missing_key_is_401_before_the_body_is_parsed_or_read(stack: tuple, locked: httpx.Client,
                                                              fake: LimitsFake) -> None:
    malformed = locked.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(malformed, 401, "invalid_api_key")
    status, body, _ = raw_post(stack[2].url, "/v1/completions", 70 << 20, b"{")
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    with_key = locked.post("/v1/chat/completions", content=b"{not json",
                           headers={"content-type": "application/json", "authorization": f"Bearer {KEY}"})
    assert_error(with_key, 400, "invalid_json")
    assert not fake.requests


def test_openapi_schema_needs_the_key(locked: httpx.Client) -> None:
    assert_error(locked.get("/openapi.json"), 401, "invalid_api_key")
    assert_error(locked.get("/docs"), 401)
    assert locked.get("/openapi.json", headers={"authorization": f"Bearer {KEY}"}).json()["info"]["title"]
    assert locked.get("/health").status_code == 200


# ---- hostile JSON --------------------------------------------------------------------

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]'
NESTED = b'{"a": ' * 20 + b"1" + b"}" * 20


@pytest.mark.parametrize("raw, code, param", [
    (b"[" * 30_000 + b"]" * 30_000, "invalid_json", None),  # past the parser's own recursion limit
    (CHAT + b', "guided_json": ' + NESTED + b"}", "invalid_json", None),
    (b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}', "invalid_value", None),
    (CHAT + b', "stop": ["ok", "\\udfff"]}', "invalid_value", None),
    (CHAT + b', "\\ud83d": 1}', "invalid_value", None),
    (CHAT + b', "user": "\\udc00\\ud800"}', "invalid_value", None),
    (CHAT + b', "temperature": NaN}', "invalid_json", None),
    (CHAT + b', "top_p": -Infinity}', "invalid_json", None),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\xff\xfe"}]}', "invalid_json", None),
    (CHAT + b', "n": "3"}', "invalid_value", "n"),
    (CHAT + b', "stream": "yes"}', "invalid_value", "stream"),
    (CHAT + b', "max_tokens": 1.5}', "invalid_value", "max_tokens"),
    (b'{"model": "m", "messages": "hi"}', "invalid_value", "messages"),
])
def test_hostile_json_is_400(http: httpx.Client, fake: LimitsFake, raw: bytes, code: str, param: str | None) -> None:
    response = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    error = assert_error(response, 400, code, param)
    assert error["type"] == "invalid_request_error" and len(error["message"]) < 400
    assert not fake.requests


def test_depth_bound_counts_levels(http: httpx.Client, fake: LimitsFake) -> None:
    """max_json_depth=16: the body, guided_json and 14 objects is 16 levels; one more is 17."""
    def body(levels: int) -> dict:
        schema: Any = 1
        for _ in range(levels):
            schema = {"a": schema}
        return chat_body(guided_json=schema)

    assert http.post("/v1/chat/completions", json=body(15)).status_code == 200
    assert_error(http.post("/v1/chat/completions", json=body(16)), 400, "invalid_json")


def _reference_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_reference_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_reference_depth, value), default=0)
    return 0


@pytest.mark.parametrize("text", [
    '1', '"[[{"', '[]', '{}', '[[], [[]], {"a": [{}]}]', '{"a": "\\\\", "b": ["]]]\\"[[["]}',
    '[["\\\\\\"[", "\\\\"], "{{"]', '{"k[": {"\\u005b": [1, 2, {"x": null}]}}', '["é😀[", [["ü]"]]]',
])
def test_depth_matches_the_parsed_nesting(text: str) -> None:
    assert limits._depth(text.encode()) == _reference_depth(json.loads(text))


def test_escaped_surrogate_pairs_and_brackets_in_strings_pass(http: httpx.Client, fake: LimitsFake) -> None:
    raw = json.dumps(chat_body("😀 [[[[{{{{ \\\" ]]", stop=["\\[{"]), ensure_ascii=True).encode()
    assert b"\\ud83d\\ude00" in raw
    assert http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"}).status_code == 200
    assert fake.requests[0].chat.messages[0].content == "😀 [[[[{{{{ \\\" ]]"


def test_unknown_fields_are_ignored_only_while_small(http: httpx.Client, fake: LimitsFake) -> None:
    newer = chat_body(store=False, metadata={"k": "v"}, messages=[
        {"role": "user", "content": "hi", "refusal": None, "annotations": []}])
    assert http.post("/v1/chat/completions", json=newer).status_code == 200
    assert_error(http.post("/v1/chat/completions", json=chat_body(junk="x" * 2000)), 400, "unknown_fields", "junk")
    nested = chat_body(messages=[{"role": "user", "content": "hi", "pad": "x" * 2000}])
    assert_error(http.post("/v1/chat/completions", json=nested), 400, "unknown_fields", "messages.0.pad")
    many = {"model": "m", "prompt": "p", **{f"f{i}": i for i in range(200)}}
    assert_error(http.post("/v1/completions", json=many), 400, "unknown_fields")
    assert len(fake.requests) == 1


# ---- size limits ---------------------------------------------------------------------

MESSAGE = {"role": "user", "content": "hi"}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"model": "m", "prompt": ["a"] * 5}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": [[1, 2]] * 5}, "prompt"),
    ("/v1/chat/completions", {"model": "m", "messages": [MESSAGE] * 9}, "messages"),
    ("/v1/chat/completions", chat_body(stop=["a", "b", "c"]), "stop"),
    ("/v1/chat/completions", chat_body(stop=["a", "sixsix"]), "stop"),
    ("/v1/completions", {"model": "m", "prompt": "p", "stop": "sixsix"}, "stop"),
    ("/v1/completions", {"model": "m", "prompt": "p", "stop_token_ids": [1, 2, 3]}, "stop_token_ids"),
    ("/v1/chat/completions", chat_body(n=5), "n"),
    ("/v1/chat/completions", chat_body(n=4, max_tokens=26), "max_tokens"),
    ("/v1/chat/completions", chat_body(n=2, max_completion_tokens=51), "max_tokens"),
    ("/v1/completions", {"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 26}, "max_tokens"),
    ("/v1/chat/completions", chat_body(logit_bias={"1": 1, "2": 1, "3": 1, "4": 1}), "logit_bias"),
])
def test_size_limits_are_400(http: httpx.Client, fake: LimitsFake, path: str, body: dict, param: str) -> None:
    error = assert_error(http.post(path, json=body), 400, "limit_exceeded", param)
    assert "bound" in error["message"]
    assert not fake.requests


def test_requests_at_the_limits_pass(http: httpx.Client, fake: LimitsFake) -> None:
    assert http.post("/v1/completions", json={"model": "m", "prompt": ["a", "b"], "n": 2, "max_tokens": 25,
                                              "stop": ["x", "fivee"], "stop_token_ids": [1, 2]}).status_code == 200
    body = chat_body(n=4, max_tokens=25, logit_bias={"1": 1, "2": 1, "3": 1}, messages=[MESSAGE] * 8)
    assert http.post("/v1/chat/completions", json=body).status_code == 200
    assert len(fake.requests) == 3


@pytest.mark.parametrize("messages", [-2**63, "x", [MESSAGE] * 9])
def test_a_completion_s_messages_field_is_an_unknown_field(http: httpx.Client, fake: LimitsFake, messages) -> None:
    # completions take no messages: the field is ignored as other unknown fields are (it was
    # counted against the chat bound, and a number there was a 500)
    assert http.post("/v1/completions", json={"model": "m", "prompt": "p", "messages": messages}).status_code == 200
    assert len(fake.requests) == 1


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "-1", "0", "abc", "1e999"])
def test_request_timeout_must_be_a_positive_finite_number(http: httpx.Client, fake: LimitsFake, value: str) -> None:
    response = http.post("/v1/chat/completions", json=chat_body(), headers={"X-Request-Timeout": value})
    assert_error(response, 400, "invalid_value", "X-Request-Timeout")
    assert not fake.requests
    ok = http.post("/v1/chat/completions", json=chat_body(), headers={"X-Request-Timeout": "2.5"})
    assert ok.status_code == 200


# ---- status mapping and finish reasons -----------------------------------------------

@pytest.mark.parametrize("stream", [False, True])
def test_resource_exhausted_without_the_queue_mark_is_413(http: httpx.Client, fake: LimitsFake, stream: bool) -> None:
    response = http.post("/v1/chat/completions", json=chat_body("too-large", stream=stream))
    assert_error(response, 413, "request_too_large")
    assert "retry-after" not in response.headers
    full = http.post("/v1/chat/completions", json=chat_body("queue-full", stream=stream))
    assert_error(full, 429, "queue_full")
    assert full.headers["retry-after"] == "3"


def test_openai_client_does_not_see_a_size_error_as_a_rate_limit(stack: tuple, fake: LimitsFake) -> None:
    client = openai.OpenAI(base_url=stack[1].url + "/v1", api_key="unused", max_retries=2)
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model="m", prompt="too-large")
    assert info.value.status_code == 413 and len(fake.requests) == 1  # not retried
    with pytest.raises(openai.RateLimitError):
        client.with_options(max_retries=0).completions.create(model="m", prompt="queue-full")


def test_every_finish_reason_is_openai_or_a_server_error() -> None:
    for value in pb.FinishReason.values():
        final = pb.StreamFinal(index=0, finish_reason=value)
        try:
            assert convert.finish_reason(final) in OPENAI_FINISH_REASONS
        except GatewayError as error:
            assert error.status >= 500 and value in (pb.FINISH_REASON_UNSPECIFIED, pb.FINISH_REASON_ABORT)


@pytest.mark.parametrize("prompt", ["aborted", "unfinished"])
def test_unfinished_completion_is_500_for_unary(http: httpx.Client, fake: LimitsFake, prompt: str) -> None:
    error = assert_error(http.post("/v1/chat/completions", json=chat_body(prompt)), 500, "generation_failed")
    assert error["type"] == "server_error" and "completion 0" in error["message"]
    assert_error(http.post("/v1/completions", json={"model": "m", "prompt": prompt}), 500, "generation_failed")


def test_aborted_completion_mid_stream_is_an_error_event(stack: tuple, http: httpx.Client, fake: LimitsFake) -> None:
    with http.stream("POST", "/v1/chat/completions", json=chat_body("aborted", stream=True)) as response:
        assert response.status_code == 200
        events = sse_events(response, failed=True)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "echo aborted 0"
    assert events[-1]["error"]["code"] == "generation_failed"
    assert all(c["finish_reason"] in (None, *OPENAI_FINISH_REASONS) for e in events[:-1] for c in e["choices"])
    client = openai.OpenAI(base_url=stack[1].url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError, match="did not complete"):
        list(client.completions.create(model="m", prompt="aborted", stream=True))


def test_limits_come_from_flags_and_forge_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    from forge_gateway.__main__ import parse_config
    from forge_service.config import ServiceConfig
    from forge_service.serve import gateway_config

    monkeypatch.setenv("FORGE_MAX_PROMPTS", "7")
    config = parse_config(["--max-body-bytes", "1000", "--max-n-tokens", "99"])
    assert (config.max_body_bytes, config.max_n_tokens, config.max_prompts, config.max_n) == (1000, 99, 7, 16)
    served = gateway_config(ServiceConfig(api_key="k"), 5)  # `forge serve`'s gateway reads them too
    assert (served.max_prompts, served.api_key, served.target) == (7, "k", "127.0.0.1:5")
