"""The service's edge on a real grpc.aio server (fake engine, real HF tokenizer): tokenizing off the
event loop and bounded, the length check before tokenizing, request limits, bounded error messages,
queue_full metadata, and requests whose bytes do not parse."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import replace
from typing import Any, Awaitable, Callable

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tokenizers import Tokenizer as BackendTokenizer

from forge_service.admission import longest_token_chars
from forge_service.config import LimitsConfig, ServiceConfig
from forge_service import convert
from forge_service.errors import MAX_DETAILS_WIRE_BYTES, bounded_details, excerpt
from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc
from forge_service.server import ForgeService
from forge_service.structured import GrammarCompiler
from forge_service.tokenizer.tokenizer import Tokenizer
from tests.tiny_models import CHATML_TEMPLATE, TINY_VOCAB_SIZE, tiny_tokenizer_json
from tests.unit.fakes import FakeEngine

pytestmark = pytest.mark.timeout(120)
CONFIG = ServiceConfig(host="127.0.0.1", grpc_port=0, drain_timeout_s=5.0)
BIG = 10 << 20  # a 10 MB prompt
HUGE = 2 << 20  # a prompt that passes the length bound and takes the tokenizer about a second
NO_CHAR_LIMIT = replace(CONFIG, limits=LimitsConfig(max_message_chars=1 << 30))  # the length bound acts alone


def tiny_tokenizer() -> Tokenizer:
    backend = BackendTokenizer.from_str(tiny_tokenizer_json())
    return Tokenizer(backend, {"eos_token": "<|endoftext|>"}, chat_template=CHATML_TEMPLATE)


class TokenizingFake(FakeEngine):
    """The fake engine with a real byte-level HF tokenizer (one token per byte) and grammar compiler."""

    def __init__(self, max_model_len: int = 8192) -> None:
        super().__init__(max_model_len=max_model_len)
        self.tokenizer = tiny_tokenizer()
        self.grammar_compiler = GrammarCompiler(self.tokenizer.backend, TINY_VOCAB_SIZE, [0])


def serve(body: Callable[[pb_grpc.ForgeStub, grpc.aio.Channel, ForgeService], Awaitable[Any]],
          fake: FakeEngine, config: ServiceConfig = CONFIG) -> Any:
    async def main() -> Any:
        service = ForgeService(config, lambda: fake)
        port = await service.start()
        await service.load()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
            try:
                return await asyncio.wait_for(body(pb_grpc.ForgeStub(channel), channel, service), 60)
            finally:
                await service.stop()

    return asyncio.run(main())


async def status_of(awaitable: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    return info.value


def text(prompt: str, **fields: Any) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=prompt, stopping=pb.StoppingParameters(max_tokens=1), **fields)


# ---- tokenizing off the event loop -----------------------------------------------------------

def test_a_10_mb_prompt_is_refused_before_tokenizing_in_well_under_a_second() -> None:
    async def body(stub: pb_grpc.ForgeStub, channel: grpc.aio.Channel, service: ForgeService) -> None:
        for request in (text("a" * BIG), pb.GenerateRequest(chat=pb.ChatInput(messages=[
                pb.ChatMessage(role="user", content="b" * BIG)]))):
            started = time.monotonic()
            error = await status_of(stub.Generate(request))
            took = time.monotonic() - started
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at least" in error.details() and "context length is 8192" in error.details()
            assert took < 0.5, f"refused after {took:.2f} s"

    serve(body, TokenizingFake(), NO_CHAR_LIMIT)


def test_health_answers_promptly_while_a_huge_prompt_is_tokenized() -> None:
    # The context is large enough that the length bound lets the prompt through to the tokenizer,
    # which then takes about a second on it (one token per byte), and small enough to refuse it after.
    fake = TokenizingFake(max_model_len=HUGE // 4)

    async def body(stub: pb_grpc.ForgeStub, channel: grpc.aio.Channel, service: ForgeService) -> None:
        health = health_pb2_grpc.HealthStub(channel)
        huge = asyncio.ensure_future(stub.Generate(text("c" * HUGE)))
        await asyncio.sleep(0.3)  # the request has arrived and is being tokenized
        delays = []
        while not huge.done():
            started = time.monotonic()
            await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            await stub.Health(pb.HealthRequest(), timeout=5)
            delays.append(time.monotonic() - started)
            await asyncio.sleep(0.02)
        error = await status_of(huge)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and f"has {HUGE} tokens" in error.details()
        assert len(delays) >= 3 and max(delays) < 0.5, delays

    serve(body, fake, NO_CHAR_LIMIT)


class _GatedTokenizer(Tokenizer):
    gate = threading.Event()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert self.gate.wait(10)
        return super().encode(text, add_special_tokens)


def test_a_full_tokenizer_queue_is_resource_exhausted_marked_queue_full() -> None:
    fake = FakeEngine()
    base = tiny_tokenizer()
    fake.tokenizer = _GatedTokenizer(base.backend, base.special_tokens)
    _GatedTokenizer.gate.clear()
    config = replace(CONFIG, tokenizer_workers=1, max_pending_tokenize=2)

    async def body(stub: pb_grpc.ForgeStub, channel: grpc.aio.Channel, service: ForgeService) -> None:
        held = [asyncio.ensure_future(stub.Generate(text(f"held {i}"))) for i in range(2)]
        while service._tokenizers.pending < 2:
            await asyncio.sleep(0.01)
        error = await status_of(stub.Generate(text("one too many")))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "tokenizer queue is full" in error.details()
        assert ("forge-error-kind", "queue_full") in tuple(error.trailing_metadata())
        _GatedTokenizer.gate.set()
        assert [r.choices[0].text for r in await asyncio.gather(*held)] == ["h", "h"]
        assert service._tokenizers.pending == 0

    try:
        serve(body, fake, config)
    finally:
        _GatedTokenizer.gate.set()


def test_tokenizer_encode_releases_the_gil() -> None:
    tokenizer, prompt = tiny_tokenizer(), "d" * (4 << 20)
    ticks, done = [], threading.Event()

    def work() -> None:
        tokenizer.encode(prompt)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    while not done.is_set():
        ticks.append(time.monotonic())
        time.sleep(0.001)
    worker.join()
    assert len(ticks) > 20, "the main thread did not run while the worker tokenized"


# ---- limits ----------------------------------------------------------------------------------

LIMITS = LimitsConfig(max_messages=3, max_message_chars=100, max_stop_chars=5, max_total_tokens=50,
                      max_logit_bias=2)


@pytest.mark.parametrize("request_, words, field", [
    (pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x")] * 4)),
     "4 messages; at most 3 are accepted (--max-messages)", "chat.messages"),
    (pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x" * 101)])),
     "chat.messages[0].content has 101 characters; at most 100", "chat.messages[0].content"),
    (pb.GenerateRequest(text="y" * 101), "the text prompt has 101 characters", "text"),
    (pb.GenerateRequest(text="y", prediction="p" * 101), "prediction has 101 characters; at most 100", "prediction"),
    (pb.GenerateRequest(text="z", stopping=pb.StoppingParameters(stop=["ok", "toolong"])),
     "stopping.stop[1] 'toolong' is longer than 5 characters (--max-stop-chars)", "stopping.stop[1]"),
    (pb.GenerateRequest(text="z", n=4, stopping=pb.StoppingParameters(max_tokens=13)),
     "n x max_tokens = 4 x 13 = 52 exceeds 50 (--max-total-tokens)", "n"),
    (pb.GenerateRequest(text="z", n=2), "n x max_tokens = 2 x 127 = 254 exceeds 50", "n"),  # unset: the context left
    (pb.GenerateRequest(text="z", sampling=pb.SamplingParameters(logit_bias={1: 1.0, 2: 1.0, 3: 1.0})),
     "logit_bias has 3 entries; at most 2 are accepted (--max-logit-bias)", "sampling.logit_bias"),
])
def test_limits_are_invalid_argument_naming_the_flag(request_: pb.GenerateRequest, words: str, field: str) -> None:
    fake = FakeEngine()

    async def body(stub: pb_grpc.ForgeStub, channel: grpc.aio.Channel, service: ForgeService) -> None:
        error = await status_of(stub.Generate(request_))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and words in error.details(), error.details()
        assert marks(error) == {"forge-error-kind": "limit_exceeded", "forge-error-field": field}
        ok = await stub.Generate(pb.GenerateRequest(text="fine", n=2, stopping=pb.StoppingParameters(max_tokens=25)))
        assert len(ok.choices) == 2
        one = await stub.Generate(pb.GenerateRequest(text="one", stopping=pb.StoppingParameters(max_tokens=60)))
        assert one.usage.completion_tokens == 60  # n = 1: bounded by the context alone

    serve(body, fake, replace(CONFIG, limits=LIMITS))
    assert len(fake.added) == 2  # only the requests within the limits reached the engine


# ---- error messages --------------------------------------------------------------------------

def test_echoed_input_is_cut_and_messages_are_bounded_on_the_wire() -> None:
    assert excerpt("short") == "'short'"
    assert excerpt("q" * 1000) == repr("q" * 200) + "… (1000 chars)"
    for message in ("x" * 10_000, "é" * 10_000, "%" * 10_000):
        cut = bounded_details(message)
        wire = sum(1 if " " <= c <= "~" and c != "%" else 3 * len(c.encode()) for c in cut)
        assert wire <= MAX_DETAILS_WIRE_BYTES and cut.endswith("… (message truncated; 10000 chars)")
    assert bounded_details("fine as it is") == "fine as it is"


@pytest.mark.parametrize("fields, code, words", [
    ({"regex": "(" * 1500 + "a" * 1500}, grpc.StatusCode.INVALID_ARGUMENT, "invalid regex"),
    ({"json_schema": json.dumps({"type": "t" * 20_000})}, grpc.StatusCode.INVALID_ARGUMENT, "invalid JSON Schema"),
    ({"model": "m" * 20_000}, grpc.StatusCode.NOT_FOUND, "… (20000 chars) is not served here"),
])
def test_huge_invalid_input_gives_a_typed_status_with_a_bounded_message(fields: dict, code: grpc.StatusCode,
                                                                         words: str) -> None:
    async def body(stub: pb_grpc.ForgeStub, channel: grpc.aio.Channel, service: ForgeService) -> None:
        error = await status_of(stub.Generate(text("hi", **fields)))
        assert error.code() == code, (error.code(), error.details()[:200])
        assert words in error.details() and len(error.details().encode()) <= MAX_DETAILS_WIRE_BYTES
        assert "forge-error-kind" not in marks(error)  # not marked queue_full
        assert (await stub.Generate(text("ok"))).choices[0].text == "o"

    serve(body, TokenizingFake())


TOOL = pb.Tool(name="f", parameters="{}")


@pytest.mark.parametrize("fields, code, field, kind", [
    ({"model": "other"}, grpc.StatusCode.NOT_FOUND, "model", None),
    ({"sampling": pb.SamplingParameters(temperature=200)}, grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature",
     None),
    ({"sampling": pb.SamplingParameters(logit_bias={10 ** 6: 1.0})}, grpc.StatusCode.INVALID_ARGUMENT,
     "sampling.logit_bias", None),
    ({"stopping": pb.StoppingParameters(max_tokens=0)}, grpc.StatusCode.INVALID_ARGUMENT, "stopping.max_tokens", None),
    ({"stopping": pb.StoppingParameters(stop_token_ids=[10 ** 6])}, grpc.StatusCode.INVALID_ARGUMENT,
     "stopping.stop_token_ids", None),
    ({"n": 17}, grpc.StatusCode.INVALID_ARGUMENT, "n", None),
    ({"top_logprobs": 3}, grpc.StatusCode.INVALID_ARGUMENT, "top_logprobs", None),
    ({"num_speculative_tokens": 65}, grpc.StatusCode.INVALID_ARGUMENT, "num_speculative_tokens", None),
    ({"tool_choice": pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)}, grpc.StatusCode.INVALID_ARGUMENT,
     "tool_choice", None),
    ({"tools": [TOOL]}, grpc.StatusCode.INVALID_ARGUMENT, "tools", None),  # tools need chat input
    ({"regex": "("}, grpc.StatusCode.INVALID_ARGUMENT, "regex", None),
    ({"json_schema": "{"}, grpc.StatusCode.INVALID_ARGUMENT, "json_schema", None),
    ({"text": "a" * 200}, grpc.StatusCode.INVALID_ARGUMENT, "text", "context_length_exceeded"),  # by its characters
    ({"chat": pb.ChatInput(messages=[pb.ChatMessage(role="user", content="b" * 120)])},  # by its tokens, templated
     grpc.StatusCode.INVALID_ARGUMENT, "chat", "context_length_exceeded"),
    ({"token_ids": pb.TokenIds(ids=[1] * 300)}, grpc.StatusCode.INVALID_ARGUMENT, "token_ids",
     "context_length_exceeded"),
    ({"chat": pb.ChatInput()}, grpc.StatusCode.INVALID_ARGUMENT, "chat", None),
])
def test_an_error_names_the_request_field_at_fault_and_its_kind(fields: dict, code: grpc.StatusCode, field: str,
                                                                kind: str | None) -> None:
    """Trailing metadata forge-error-field: the GenerateRequest path of the field at fault, and
    forge-error-kind where a client may act on it (a prompt too long for the context)."""
    async def body(stub: pb_grpc.ForgeStub, channel: grpc.aio.Channel, service: ForgeService) -> None:
        request = pb.GenerateRequest(stopping=pb.StoppingParameters(max_tokens=1))
        request.MergeFrom(pb.GenerateRequest(**({"text": "hi"} if not {"text", "chat", "token_ids"} & set(fields)
                                                 else {}), **fields))
        error = await status_of(stub.Generate(request))
        assert error.code() == code, error.details()
        assert marks(error) == {"forge-error-field": field, **({"forge-error-kind": kind} if kind else {})}

    serve(body, TokenizingFake(max_model_len=128), NO_CHAR_LIMIT)


def test_tokenize_counts_the_prompt_generate_would_feed_and_detokenize_reverses_it() -> None:
    fake = TokenizingFake(max_model_len=128)

    async def body(stub: pb_grpc.ForgeStub, channel: grpc.aio.Channel, service: ForgeService) -> None:
        chat = pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="hi there")]),
                                  tools=[TOOL])
        counted = await stub.Tokenize(chat)
        fed = convert.prompt_token_ids(chat, fake.tokenizer, 1 << 20, convert.tools(chat, fake.tokenizer))  # unbounded
        assert list(counted.token_ids) == fed and counted.count == len(fed) and counted.max_model_len == 128
        long = await stub.Tokenize(pb.GenerateRequest(text="a" * 300))  # past the context: counted, not refused
        assert long.count == 300 == len(long.token_ids)
        assert (await stub.Detokenize(pb.DetokenizeRequest(token_ids=fed))).text == fake.tokenizer.decode(fed)
        for call, request, code, field in [
                (stub.Detokenize, pb.DetokenizeRequest(token_ids=[10 ** 6]), grpc.StatusCode.INVALID_ARGUMENT,
                 "token_ids"),
                (stub.Detokenize, pb.DetokenizeRequest(model="other"), grpc.StatusCode.NOT_FOUND, "model"),
                (stub.Tokenize, pb.GenerateRequest(model="other", text="x"), grpc.StatusCode.NOT_FOUND, "model"),
                (stub.Tokenize, pb.GenerateRequest(chat=pb.ChatInput()), grpc.StatusCode.INVALID_ARGUMENT, "chat"),
                (stub.Tokenize, pb.GenerateRequest(text="y" * 2000), grpc.StatusCode.INVALID_ARGUMENT, "text")]:
            error = await status_of(call(request))
            assert error.code() == code and marks(error)["forge-error-field"] == field, error.details()
        assert not fake.added  # nothing was generated

    serve(body, fake, replace(CONFIG, limits=LimitsConfig(max_message_chars=1000)))


def marks(error: grpc.aio.AioRpcError) -> dict[str, str]:
    return dict(tuple(error.trailing_metadata() or ()))


# ---- requests that do not parse --------------------------------------------------------------

INVALID_UTF8_TEXT = b"\x1a\x02\xff\xfe"  # GenerateRequest.text (field 3) = bytes that are not UTF-8


@pytest.mark.parametrize("method, streaming", [("/forge.v1.Forge/Generate", False), ("/forge.v1.Forge/Stream", True)])
def test_invalid_utf8_in_a_string_field_is_invalid_argument(method: str, streaming: bool) -> None:
    async def body(stub: pb_grpc.ForgeStub, channel: grpc.aio.Channel, service: ForgeService) -> None:
        raw = (channel.unary_stream if streaming else channel.unary_unary)(method)  # bytes in, bytes out
        call = raw(INVALID_UTF8_TEXT)
        error = await status_of(_drain(call) if streaming else call)
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (error.code(), error.details())
        assert "UTF-8" in error.details()
        assert (await stub.Generate(text("still fine"))).choices[0].text == "s"

    serve(body, FakeEngine())


async def _drain(call: Any) -> None:
    async for _ in call:
        pass


def test_the_length_bound_holds_only_for_tokenizers_that_never_shorten_text() -> None:
    from tokenizers import normalizers

    tokenizer = tiny_tokenizer()
    assert longest_token_chars(tokenizer) == len("<|reserved_10|>")  # the longest added token
    tokenizer.backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    assert longest_token_chars(tokenizer) == len("<|reserved_10|>")
    for shortening in (normalizers.NFC(), normalizers.Strip(), normalizers.Replace("ab", "c"),
                       normalizers.Sequence([normalizers.Prepend("▁"), normalizers.NFKC()])):
        tokenizer.backend.normalizer = shortening
        assert longest_token_chars(tokenizer) is None, shortening
