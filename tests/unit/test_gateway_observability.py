"""The gateway's request ids, metrics and spans, against the fake Forge servicer of test_gateway."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import grpc
import httpx
import pytest
import uvicorn
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from prometheus_client.parser import text_string_to_metric_families

from forge_gateway.app import create_app
from forge_gateway.config import GatewayConfig
from forge_service.pb import forge_pb2_grpc as pb_grpc
from tests.unit.test_gateway import FakeForge, chat_body

pytestmark = pytest.mark.timeout(60)


class RecordingForge(FakeForge):
    """FakeForge that also keeps each call's metadata."""

    def __init__(self) -> None:
        super().__init__()
        self.metadata: list[dict[str, str]] = []

    def _admit(self, request: Any, context: grpc.ServicerContext) -> str:
        self.metadata.append(dict(context.invocation_metadata()))
        return super()._admit(request, context)


class TracedGateway:
    def __init__(self, target: str, tracer: Any) -> None:
        self.server = uvicorn.Server(uvicorn.Config(create_app(GatewayConfig(target=target), tracer=tracer),
                                                    host="127.0.0.1", port=0, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"


@pytest.fixture(scope="module")
def stack() -> Iterator[tuple[RecordingForge, TracedGateway, InMemorySpanExporter]]:
    fake = RecordingForge()
    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ForgeServicer_to_server(fake, server)
    target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    gateway = TracedGateway(target, provider.get_tracer("test"))
    yield fake, gateway, spans
    gateway.server.should_exit = True
    gateway.thread.join(10)
    server.stop(None)


@pytest.fixture
def http(stack: tuple) -> Iterator[httpx.Client]:
    stack[0].requests.clear()
    stack[0].metadata.clear()
    stack[2].clear()
    with httpx.Client(base_url=stack[1].url, timeout=10) as client:
        yield client


def metrics(http: httpx.Client) -> dict[tuple[str, frozenset], float]:
    text = http.get("/metrics").text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def count(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_the_request_id_is_echoed_and_sent_to_the_service(stack: tuple, http: httpx.Client) -> None:
    fake = stack[0]
    named = http.post("/v1/chat/completions", json=chat_body(), headers={"X-Request-Id": "req-42"})
    streamed = http.post("/v1/chat/completions", json=chat_body(stream=True), headers={"X-Request-Id": "req-43"})
    fresh = http.post("/v1/chat/completions", json=chat_body())
    odd = http.post("/v1/chat/completions", json=chat_body(), headers={"X-Request-Id": "x" * 129})
    assert named.headers["x-request-id"] == "req-42" and streamed.headers["x-request-id"] == "req-43"
    generated, replaced = fresh.headers["x-request-id"], odd.headers["x-request-id"]
    assert len(generated) == 32 and len(replaced) == 32 and generated != replaced
    assert [m["x-request-id"] for m in fake.metadata] == ["req-42", "req-43", generated, replaced]
    assert [r.request_id for r in fake.requests] == ["req-42", "req-43", generated, replaced]
    assert http.post("/v1/chat/completions", json={}).headers["x-request-id"]  # errors have one too


def test_metrics_count_routes_statuses_streams_and_grpc_errors(http: httpx.Client) -> None:
    before = metrics(http)
    assert http.post("/v1/chat/completions", json=chat_body()).status_code == 200
    with http.stream("POST", "/v1/chat/completions", json=chat_body("slow", stream=True)) as stream:
        lines = stream.iter_lines()  # held: a dropped iterator closes the stream
        next(lines)
        during = metrics(http)
    assert http.post("/v1/chat/completions", json=chat_body("queue-full")).status_code == 429
    assert http.post("/v1/completions", json={"model": "m", "prompt": "bad-arg"}).status_code == 400
    assert http.get("/no/such/path").status_code == 404
    after = metrics(http)
    assert count(during, "forge_gateway_sse_streams_open") == 1
    assert count(after, "forge_gateway_sse_streams_open") == 0

    def added(name: str, **labels: str) -> float:
        return count(after, name, **labels) - count(before, name, **labels)

    requests = "forge_gateway_http_requests_total"
    assert added(requests, route="/v1/chat/completions", method="POST", status_code="200") == 2
    assert added(requests, route="/v1/chat/completions", method="POST", status_code="429") == 1
    assert added(requests, route="/v1/completions", method="POST", status_code="400") == 1
    assert added(requests, route="unmatched", method="GET", status_code="404") == 1
    assert added("forge_gateway_http_request_duration_seconds_count", route="/v1/chat/completions") == 3
    errors = "forge_gateway_grpc_errors_total"
    assert added(errors, method="/forge.v1.Forge/Generate", code="RESOURCE_EXHAUSTED") == 1
    assert added(errors, method="/forge.v1.Forge/Generate", code="INVALID_ARGUMENT") == 1
    assert added(errors, method="/forge.v1.Forge/Stream", code="CANCELLED") == 1  # the client left the slow one


def test_spans_continue_the_clients_traceparent_and_propagate_it(stack: tuple, http: httpx.Client) -> None:
    fake, _, exporter = stack
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    for stream in (False, True):
        http.post("/v1/chat/completions", json=chat_body(stream=stream),
                  headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    deadline = time.monotonic() + 5
    while len(exporter.get_finished_spans()) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    spans = exporter.get_finished_spans()
    http_spans = [s for s in spans if s.kind == SpanKind.SERVER]
    client_spans = [s for s in spans if s.kind == SpanKind.CLIENT]
    assert [s.name for s in http_spans] == ["POST /v1/chat/completions"] * 2
    assert sorted(s.name for s in client_spans) == ["forge.v1.Forge/Generate", "forge.v1.Forge/Stream"]
    for span in spans:
        assert format(span.context.trace_id, "032x") == trace_id
    for span in http_spans:
        assert format(span.parent.span_id, "016x") == parent_id
        assert span.attributes["http.response.status_code"] == 200
    for client, metadata in zip(sorted(client_spans, key=lambda s: s.start_time), fake.metadata):
        assert client.parent.span_id in {s.context.span_id for s in http_spans}
        assert metadata["traceparent"] == f"00-{trace_id}-{format(client.context.span_id, '016x')}-01"


def test_metrics_need_no_api_key_where_the_api_does() -> None:
    async def main() -> tuple[int, int]:
        app = create_app(GatewayConfig(api_key="sekret"))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as client:
            return (await client.get("/metrics")).status_code, (await client.get("/v1/models")).status_code

    assert asyncio.run(main()) == (200, 401)
