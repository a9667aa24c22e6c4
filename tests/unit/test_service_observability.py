"""The servicer's request ids, completion log lines, server spans and rejection count (fake engine),
the JSON log format, and uvicorn's lines in Forge's text format."""
from __future__ import annotations

import asyncio
import io
import json
import logging
import re
from typing import Any

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from forge_service.config import ServiceConfig, traces_endpoint
from forge_service.logs import JsonFormatter, _ContextFilter, request_id_set, setup_logging
from forge_service.pb import forge_pb2_grpc as pb_grpc
from forge_service.server import ForgeService
from tests.unit.fakes import FakeEngine, forge_serve_fake
from tests.unit.test_server_fake_engine import text_request

pytestmark = pytest.mark.timeout(60)
CONFIG = ServiceConfig(host="127.0.0.1", grpc_port=0, drain_timeout_s=5.0)


def serve(body: Any, fake: FakeEngine, **service: Any) -> Any:
    async def main() -> Any:
        forge = ForgeService(CONFIG, lambda: fake, **service)
        port = await forge.start()
        await forge.load()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                return await asyncio.wait_for(body(forge, pb_grpc.ForgeStub(channel)), 30)
            finally:
                await forge.stop()

    return asyncio.run(main())


def test_each_rpc_logs_one_completion_line_under_its_request_id(caplog: pytest.LogCaptureFixture) -> None:
    async def body(forge: ForgeService, stub: Any) -> None:
        await stub.Generate(text_request("hello", max_tokens=3), metadata=[("x-request-id", "meta-id")])
        messages = [m async for m in stub.Stream(text_request("stream me", max_tokens=4, request_id="proto-id"))]
        assert messages[-1].final.usage.completion_tokens == 4
        with pytest.raises(grpc.aio.AioRpcError):
            await stub.Generate(text_request("bad", max_tokens=3, model="other"), metadata=[("x-request-id", "nf")])

    with caplog.at_level(logging.INFO, logger="forge.requests"):
        serve(body, FakeEngine())
    lines = {r.fields["request_id"]: r for r in caplog.records if r.name == "forge.requests"}
    assert set(lines) == {"meta-id", "proto-id", "nf"}
    assert lines["meta-id"].fields["completion_tokens"] == 3 and lines["meta-id"].fields["prompt_tokens"] == 5
    assert lines["proto-id"].fields["rpc"] == "Stream" and lines["proto-id"].fields["completion_tokens"] == 4
    assert lines["proto-id"].fields["finish_reason"] == "length" and lines["proto-id"].fields["ttft_s"] > 0
    assert lines["nf"].fields["status"] == "NOT_FOUND" and lines["nf"].fields["completion_tokens"] == 0


def test_a_full_queue_counts_as_rejected() -> None:
    fake = FakeEngine()
    fake.block_adds = True  # add_request raises QueueFull

    async def body(forge: ForgeService, stub: Any) -> float:
        for _ in range(3):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.Generate(text_request("x", max_tokens=2))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        return forge.metrics.registry.get_sample_value("forge_requests_rejected_total",
                                                       {"model_name": "fake-model"})

    assert serve(body, fake) == 3


def test_the_server_span_continues_the_callers_traceparent() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"

    async def body(forge: ForgeService, stub: Any) -> None:
        await stub.Generate(text_request("traced", max_tokens=3, request_id="t-1"),
                            metadata=[("traceparent", f"00-{trace_id}-{parent_id}-01")])

    serve(body, FakeEngine(), tracer=provider.get_tracer("test"))
    (span,) = exporter.get_finished_spans()
    assert span.kind == SpanKind.SERVER and span.name == "forge.v1.Forge/Generate"
    assert format(span.context.trace_id, "032x") == trace_id and format(span.parent.span_id, "016x") == parent_id
    assert span.attributes["gen_ai.usage.input_tokens"] == 6 and span.attributes["gen_ai.usage.output_tokens"] == 3
    assert span.attributes["gen_ai.request.max_tokens"] == 3 and span.attributes["forge.request_id"] == "t-1"
    assert span.attributes["gen_ai.response.finish_reasons"] == ("length",)


def test_json_lines_carry_request_and_trace_ids() -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(_ContextFilter())
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("test.json")
    logger.addHandler(handler)
    logger.propagate = False
    tracer = TracerProvider().get_tracer("test")
    try:
        logger.warning("plain %d", 1)
        with request_id_set("r-9"), tracer.start_as_current_span("s") as span:
            logger.warning("inside", extra={"fields": {"tokens": 5}})
    finally:
        logger.removeHandler(handler)
    plain, inside = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert plain["message"] == "plain 1" and plain["level"] == "WARNING" and plain["logger"] == "test.json"
    assert "request_id" not in plain and "trace_id" not in plain
    assert inside["request_id"] == "r-9" and inside["tokens"] == 5
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert inside["span_id"] == format(span.get_span_context().span_id, "016x")


def test_uvicorn_lines_read_like_forges_own_in_text_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The gateway's uvicorn keeps no log config of its own: its access line for a request reaches the
    root handler, with the timestamp and the request id that Forge's text lines carry; its server
    lines are uvicorn's, not `uvicorn.error`'s."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    uvicorn_loggers = [logging.getLogger(name) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")]
    for logger in uvicorn_loggers:  # as in a fresh process, whatever other tests' servers set
        logger.handlers, logger.propagate = [], True
    stream = io.StringIO()
    monkeypatch.setenv("GRPC_VERBOSITY", "ERROR")  # what setup_logging sets, undone after the test
    try:
        setup_logging("info", "text")
        root.handlers[0].setStream(stream)
        with forge_serve_fake() as config:
            answer = httpx.post(f"http://127.0.0.1:{config.http_port}/v1/completions", headers={"X-Request-Id": "r-42"},
                                json={"model": "fake-model", "prompt": "hi", "max_tokens": 2})
            assert answer.status_code == 200, answer.text
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    lines = stream.getvalue().splitlines()
    assert any(re.search(r" INFO uvicorn: Application startup complete\.$", text) for text in lines), lines
    assert not any("uvicorn.error" in text for text in lines), lines
    access = [line for line in lines if " uvicorn.access " in line]
    line = r'\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO uvicorn\.access \[r-42\]: 127\.0\.0\.1:\d+ - "POST /v1/completions HTTP/1\.1" 200'
    assert any(re.fullmatch(line, text) for text in access), access


def test_tracing_is_off_unless_an_endpoint_is_set() -> None:
    assert traces_endpoint(None, {}) is None
    assert traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == "http://c:4317"
    assert traces_endpoint(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
                                  "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317"}) == "http://t:4317"
    assert traces_endpoint("http://flag:4317", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) == "http://flag:4317"
    assert traces_endpoint("http://flag:4317", {"OTEL_SDK_DISABLED": "true"}) is None
