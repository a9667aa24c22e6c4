"""The gateway's request ids, Prometheus metrics and spans: an ASGI middleware for HTTP and a
gRPC client interceptor for the calls to the service.

Metrics are named `forge_gateway_*` and served at the gateway's own `/metrics`.
"""
from __future__ import annotations

import asyncio
import re
import time
import uuid
from functools import partial
from typing import Any, Awaitable, Callable

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, Tracer
from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               ProcessCollector, generate_latest)
from starlette.responses import Response

from forge_service import tracing
from forge_service.logs import REQUEST_ID

# An HTTP request's latency, a stream's included: ~10 ms for an error, minutes for a long stream.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5, 10.0, 15.0, 30.0,
                   60.0, 120.0, 300.0, 600.0)
# Ids are echoed into gRPC metadata and logs: printable ASCII without spaces, bounded.
_REQUEST_ID = re.compile(r"[!-~]{1,128}")
_UNMATCHED = "unmatched"  # the route label of paths no route serves (keeps the label set small)

ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class GatewayMetrics:
    """The gateway's metrics, on its own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry
        self.requests = Counter("forge_gateway_http_requests", "HTTP requests, by route, method and status code.",
                                ["route", "method", "status_code"], registry=r)
        self.latency = Histogram("forge_gateway_http_request_duration_seconds", "From the request to the end "
                                 "of the response (a whole SSE stream included), by route.", ["route"],
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.open_streams = Gauge("forge_gateway_sse_streams_open", "SSE responses being streamed.", registry=r)
        self.grpc_errors = Counter("forge_gateway_grpc_errors", "gRPC calls to the service that ended in an "
                                   "error, by method and status code.", ["method", "code"], registry=r)

    def endpoint(self, request: Any) -> Response:
        """GET /metrics in the Prometheus text format."""
        return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)


def request_id_from(headers: list[tuple[bytes, bytes]]) -> str:
    """The client's X-Request-Id when it is a usable id, else a new one."""
    for name, value in headers:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            return text if _REQUEST_ID.fullmatch(text) else uuid.uuid4().hex
    return uuid.uuid4().hex


class ObservabilityMiddleware:
    """Per HTTP request: the request id (X-Request-Id in and out, `request.state.request_id`, log
    lines), the HTTP server span continuing the client's W3C traceparent, and the metrics."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, tracer: Tracer | None = None) -> None:
        self.app, self.metrics, self.tracer = app, metrics, tracer

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope["headers"])
        scope.setdefault("state", {})["request_id"] = request_id
        started, response = time.perf_counter(), {"status": 500, "sse": False}
        span, attached = self._start_span(scope)
        id_token = REQUEST_ID.set(request_id)

        async def send_observed(message: dict) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
                response["status"] = message["status"]
                if _is_event_stream(message["headers"]):
                    response["sse"] = True
                    self.metrics.open_streams.inc()
            await send(message)

        try:
            await self.app(scope, receive, send_observed)
        finally:
            REQUEST_ID.reset(id_token)
            if response["sse"]:
                self.metrics.open_streams.dec()
            route = getattr(scope.get("route"), "path", _UNMATCHED)
            self.metrics.requests.labels(route, scope["method"], str(response["status"])).inc()
            self.metrics.latency.labels(route).observe(time.perf_counter() - started)
            if span is not None:
                _end_http_span(span, scope["method"], route, response["status"])
                otel_context.detach(attached)

    def _start_span(self, scope: dict) -> tuple[Span | None, Any]:
        if self.tracer is None:
            return None, None
        headers = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in scope["headers"]]
        span = self.tracer.start_span(scope["method"], context=tracing.extract(headers), kind=SpanKind.SERVER,
                                      attributes={"http.request.method": scope["method"], "url.path": scope["path"],
                                                  tracing.REQUEST_ID: scope["state"]["request_id"]})
        return span, otel_context.attach(trace.set_span_in_context(span))


def _is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers)


def _end_http_span(span: Span, method: str, route: str, status: int) -> None:
    span.update_name(f"{method} {route}")
    span.set_attributes({"http.route": route, "http.response.status_code": status})
    if status >= 500:
        span.set_status(Status(StatusCode.ERROR))
    span.end()


def client_interceptors(metrics: GatewayMetrics, tracer: Tracer | None = None) -> list[Any]:
    """The channel's interceptors (grpc.aio files each under one kind only: one object per kind)."""
    return [_UnaryUnary(metrics, tracer), _UnaryStream(metrics, tracer)]


class _ClientInterceptor:
    """On every call to the service: `x-request-id` and W3C `traceparent` metadata, a client span,
    and the error count by status code."""

    def __init__(self, metrics: GatewayMetrics, tracer: Tracer | None = None) -> None:
        self.metrics, self.tracer = metrics, tracer
        self._pending: set[asyncio.Task] = set()

    async def _intercept(self, continuation: Callable, details: Any, request: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        metadata = list(details.metadata or ())
        request_id = REQUEST_ID.get()
        if request_id:
            metadata.append(("x-request-id", request_id))
        span = None
        if self.tracer is not None:
            service, _, name = method.strip("/").rpartition("/")
            span = self.tracer.start_span(method.strip("/"), kind=SpanKind.CLIENT, attributes={
                "rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
            metadata.extend(tracing.inject(span))
        try:
            call = await continuation(details._replace(metadata=grpc.aio.Metadata(*metadata)), request)
        except BaseException:
            if span is not None:
                span.end()
            raise
        call.add_done_callback(partial(self._done, method, span))
        return call

    def _done(self, method: str, span: Span | None, call: Any) -> None:
        # The call's status is read with an await; it is already there, so this task ends at once.
        task = asyncio.ensure_future(self._finish(method, span, call, time.time_ns()))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _finish(self, method: str, span: Span | None, call: Any, ended_ns: int) -> None:
        code = await call.code()
        if code != grpc.StatusCode.OK:
            self.metrics.grpc_errors.labels(method, code.name).inc()
        if span is not None:
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, code.name))
            span.end(end_time=ended_ns)


class _UnaryUnary(_ClientInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable, details: Any, request: Any) -> Any:
        return await self._intercept(continuation, details, request)


class _UnaryStream(_ClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable, details: Any, request: Any) -> Any:
        return await self._intercept(continuation, details, request)
