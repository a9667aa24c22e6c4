"""OpenTelemetry traces: the tracer (OTLP/gRPC export), W3C propagation, engine spans.

Tracing is off (no tracer, nothing on the hot path) unless an OTLP endpoint is configured. The
tracer is passed to whoever makes spans; no global provider is installed. Prompts and outputs
are never recorded.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from forge_service.config import traces_endpoint

log = logging.getLogger(__name__)

PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent / tracestate
# OpenTelemetry GenAI semantic conventions, plus the latencies the spec leaves open.
MODEL = "gen_ai.request.model"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
INPUT_TOKENS = "gen_ai.usage.input_tokens"
OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
RESPONSE_ID = "gen_ai.response.id"
TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
TIME_IN_PREFILL = "gen_ai.latency.time_in_model_prefill"
TIME_IN_DECODE = "gen_ai.latency.time_in_model_decode"
E2E = "gen_ai.latency.e2e"
REQUEST_ID = "forge.request_id"


@dataclass(frozen=True)
class Tracing:
    """A tracer and how to flush it at exit."""

    tracer: Tracer
    shutdown: Callable[[], None]


def setup_tracing(endpoint: str | None, service_name: str) -> Tracing | None:
    """A tracer exporting to `endpoint` over OTLP/gRPC in batches, or None when tracing is off.

    OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES override `service_name`; the exporter and
    batch processor read their own OTEL_* variables (OTEL_EXPORTER_OTLP_INSECURE, headers,
    OTEL_BSP_SCHEDULE_DELAY...); the sampler reads OTEL_TRACES_SAMPLER."""
    if not endpoint:
        return None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    log.info("tracing on: OTLP/gRPC to %s as %s", endpoint, resource.attributes.get(SERVICE_NAME))
    return Tracing(provider.get_tracer("forge"), provider.shutdown)


@contextlib.contextmanager
def traced(configured_endpoint: str | None, service_name: str) -> Iterator[Tracer | None]:
    """A process's tracer (None when tracing is off) while inside; spans are flushed at exit."""
    tracing = setup_tracing(traces_endpoint(configured_endpoint), service_name)
    try:
        yield None if tracing is None else tracing.tracer
    finally:
        if tracing is not None:
            tracing.shutdown()


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, Any]]) -> Any:
    """The OpenTelemetry context in W3C headers or gRPC metadata (keys are lower case in both)."""
    if not isinstance(carrier, Mapping):
        carrier = {key: value for key, value in carrier if isinstance(value, str)}
    return PROPAGATOR.extract(carrier)


def inject(span: Span) -> list[tuple[str, str]]:
    """`span`'s context as W3C headers / gRPC metadata pairs."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return list(carrier.items())


class MonotonicClock:
    """Turns time.monotonic() seconds (the engine's timestamps) into epoch nanoseconds (spans')."""

    def __init__(self) -> None:
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns


def record_engine_span(tracer: Tracer, parent: Span, clock: MonotonicClock, times: Any, *,
                       index: int, prompt_tokens: int, output_tokens: int, finish_reason: str | None) -> None:
    """The engine's span for one completion, from queued to finished, with an event at each stage.

    Built after the fact from the engine's timestamps, so the engine thread never touches a span."""
    attributes: dict[str, Any] = {"forge.completion.index": index, INPUT_TOKENS: prompt_tokens,
                                  OUTPUT_TOKENS: output_tokens}
    if finish_reason:
        attributes[FINISH_REASONS] = [finish_reason]
    stages = [("queued", times.queued), ("scheduled", times.scheduled), ("first_token", times.first_token),
              ("finished", times.finished)]
    if times.scheduled is not None:
        attributes[TIME_IN_QUEUE] = times.scheduled - times.queued
    if times.first_token is not None:
        attributes[TIME_TO_FIRST_TOKEN] = times.first_token - times.queued
        if times.scheduled is not None:
            attributes[TIME_IN_PREFILL] = times.first_token - times.scheduled
        if times.last_token is not None:
            attributes[TIME_IN_DECODE] = times.last_token - times.first_token
    if times.finished is not None:
        attributes[E2E] = times.finished - times.queued
    end = times.finished if times.finished is not None else time.monotonic()
    span = tracer.start_span("forge.engine.generate", context=trace.set_span_in_context(parent),
                             kind=SpanKind.INTERNAL, attributes=attributes, start_time=clock.ns(times.queued))
    for name, at in stages:
        if at is not None:
            span.add_event(name, timestamp=clock.ns(at))
    span.end(end_time=clock.ns(end))
