"""Traces end to end: a real service and a real gateway (two processes) export over OTLP/gRPC to a
receiver in this test; one trace per request, correctly parented, with the usage token counts."""
from __future__ import annotations

import json
import secrets
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import grpc
import httpx
import pytest

from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc
from tests.integration.serving.servers import SERVER_THREADS, ForgeProcess, free_port, running_forge

trace_service = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")
trace_messages = pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

PROMPT = "Name a colour of the rainbow."  # must appear in no span
CHAT = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 6, "temperature": 0}
SERVER_KIND, CLIENT_KIND, INTERNAL_KIND = 2, 3, 1  # opentelemetry.proto.trace.v1.Span.SpanKind


@dataclass
class ReceivedSpan:
    service: str
    span: Any  # opentelemetry.proto.trace.v1.Span

    @property
    def trace_id(self) -> str:
        return self.span.trace_id.hex()

    @property
    def span_id(self) -> str:
        return self.span.span_id.hex()

    @property
    def parent_id(self) -> str:
        return self.span.parent_span_id.hex()

    def attr(self, key: str) -> Any:
        for kv in self.span.attributes:
            if kv.key == key:
                value = kv.value
                kind = value.WhichOneof("value")
                if kind == "array_value":
                    return [v.string_value for v in value.array_value.values]
                return getattr(value, kind)
        return None


class Receiver(trace_service.TraceServiceServicer):
    """An OTLP/gRPC trace receiver that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()

    def Export(self, request: Any, context: Any) -> Any:
        with self._lock:
            for resource_spans in request.resource_spans:
                service = next((kv.value.string_value for kv in resource_spans.resource.attributes
                                if kv.key == "service.name"), "")
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend(ReceivedSpan(service, s) for s in scope_spans.spans)
        return trace_messages.ExportTraceServiceResponse()

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, count: int, timeout_s: float = 20) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout_s
        while len(self.of_trace(trace_id)) < count and time.monotonic() < deadline:
            time.sleep(0.1)
        return self.of_trace(trace_id)


@pytest.fixture(scope="module")
def receiver() -> Iterator[tuple[Receiver, int]]:
    servicer = Receiver()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    trace_service.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, port
    server.stop(None)


@pytest.fixture(scope="module")
def traced_servers(receiver: tuple[Receiver, int]) -> Iterator[tuple[ForgeProcess, ForgeProcess]]:
    """`python -m forge_service` and `python -m forge_gateway`, both exporting to the receiver."""
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver[1]}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    service_cmd = [sys.executable, "-m", "forge_service", "--grpc-port", "{grpc_port}", "--metrics-port",
                   "{metrics_port}", *SERVER_THREADS, "--log-format", "json"]
    with running_forge([], command=service_cmd, env=env) as service:
        gateway_cmd = [sys.executable, "-m", "forge_gateway", "--target", service.target, "--port", "{http_port}",
                       "--log-format", "json"]
        with running_forge([], command=gateway_cmd, env=env) as gateway:
            service.wait_ready()
            gateway.wait_until(lambda: _healthy(gateway.url), 30, "gateway /health 200")
            yield service, gateway


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _traceparent() -> tuple[str, str, str]:
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    return trace_id, parent_id, f"00-{trace_id}-{parent_id}-01"


def _chat(gateway: ForgeProcess, model: str, stream: bool, traceparent: str,
          request_id: str) -> tuple[httpx.Response, dict]:
    body = {**CHAT, "model": model, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    response = httpx.post(gateway.url + "/v1/chat/completions", json=body, timeout=120,
                          headers={"traceparent": traceparent, "x-request-id": request_id})
    assert response.status_code == 200, response.text
    if not stream:
        return response, response.json()["usage"]
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    return response, next(e["usage"] for e in events if e.get("usage"))


def _assert_request_trace(spans: list[ReceivedSpan], method: str, client_parent: str, usage: dict,
                          gateway: str = "forge-gateway", service: str = "forge-service") -> None:
    assert len(spans) == 4, [(s.service, s.span.name) for s in spans]
    http = next(s for s in spans if s.service == gateway and s.span.name.startswith("POST "))
    client = next(s for s in spans if s.service == gateway and s.span.kind == CLIENT_KIND)
    server = next(s for s in spans if s.service == service and s.span.kind == SERVER_KIND and s is not http)
    engine = next(s for s in spans if s.service == service and s.span.kind == INTERNAL_KIND)
    assert http.span.name == "POST /v1/chat/completions" and http.parent_id == client_parent
    assert http.attr("http.response.status_code") == 200
    assert client.span.name == f"forge.v1.Forge/{method}" and client.parent_id == http.span_id
    assert server.span.name == f"forge.v1.Forge/{method}" and server.parent_id == client.span_id
    assert engine.span.name == "forge.engine.generate" and engine.parent_id == server.span_id
    for span in (server, engine):
        assert span.attr("gen_ai.usage.input_tokens") == usage["prompt_tokens"]
        assert span.attr("gen_ai.usage.output_tokens") == usage["completion_tokens"]
        assert span.attr("gen_ai.response.finish_reasons") == ["length"]
    assert server.attr("gen_ai.request.max_tokens") == CHAT["max_tokens"]
    assert server.attr("gen_ai.request.temperature") == 0.0
    assert server.attr("gen_ai.request.model")
    assert server.attr("gen_ai.latency.time_in_queue") == engine.attr("gen_ai.latency.time_in_queue")
    assert 0 < server.attr("gen_ai.latency.time_to_first_token")
    assert [e.name for e in engine.span.events] == ["queued", "scheduled", "first_token", "finished"]
    times = [e.time_unix_nano for e in engine.span.events]
    assert times == sorted(times) and engine.span.start_time_unix_nano <= times[0]
    assert 0 <= engine.attr("gen_ai.latency.time_in_queue") <= engine.attr("gen_ai.latency.time_to_first_token")
    assert server.span.start_time_unix_nano <= engine.span.start_time_unix_nano
    assert engine.span.end_time_unix_nano <= server.span.end_time_unix_nano
    for span in spans:  # prompts and outputs are never recorded
        assert PROMPT not in str(span.span.attributes) + str(span.span.events)


def test_streamed_and_unary_chats_each_make_one_trace_across_both_processes(receiver, traced_servers) -> None:
    spans_in, _ = receiver
    service, gateway = traced_servers
    for stream, method in ((True, "Stream"), (False, "Generate")):
        trace_id, parent_id, traceparent = _traceparent()
        response, usage = _chat(gateway, service.health().model, stream, traceparent, f"traced-{method}")
        assert response.headers["x-request-id"] == f"traced-{method}"
        _assert_request_trace(spans_in.wait_for(trace_id, 4), method, parent_id, usage)
        # The service's completion log line carries the request id and this trace id.
        lines = [json.loads(line) for line in service.log_tail(200_000).splitlines() if line.strip()]
        done = [line for line in lines if line.get("logger") == "forge.requests"
                and line.get("request_id") == f"traced-{method}"]
        assert len(done) == 1 and done[0]["trace_id"] == trace_id, done


def test_a_grpc_client_with_its_own_traceparent_gets_its_trace_continued(receiver, traced_servers) -> None:
    spans_in, _ = receiver
    service, _ = traced_servers
    trace_id, parent_id, traceparent = _traceparent()
    with grpc.insecure_channel(service.target) as channel:
        response = pb_grpc.ForgeStub(channel).Generate(
            pb.GenerateRequest(text="The sky is", stopping=pb.StoppingParameters(max_tokens=3)),
            metadata=[("traceparent", traceparent), ("x-request-id", "grpc-own-trace")], timeout=60)
    spans = spans_in.wait_for(trace_id, 2)
    server = next(s for s in spans if s.span.kind == SERVER_KIND)
    engine = next(s for s in spans if s.span.kind == INTERNAL_KIND)
    assert server.service == "forge-service" and server.parent_id == parent_id
    assert server.attr("forge.request_id") == "grpc-own-trace"
    assert engine.parent_id == server.span_id
    assert engine.attr("gen_ai.usage.output_tokens") == response.usage.completion_tokens == 3


def test_forge_serve_traces_gateway_and_service_in_one_process(receiver) -> None:
    spans_in, port = receiver
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    with running_forge([*SERVER_THREADS], env=env) as forge:
        forge.wait_ready()
        trace_id, parent_id, traceparent = _traceparent()
        _, usage = _chat(forge, forge.health().model, True, traceparent, "one-process")
        _assert_request_trace(spans_in.wait_for(trace_id, 4), "Stream", parent_id, usage, "forge", "forge")
