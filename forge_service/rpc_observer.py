"""One generation RPC as an operator sees it: its request id, its server span and engine spans,
and the one log line that records how it ended."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterator

import grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode, Tracer

from forge_service import tracing
from forge_service.logs import request_id_set

log = logging.getLogger("forge.requests")
_SERVICE = "forge.v1.Forge"


@dataclass
class RpcRecord:
    """What one Generate/Stream RPC did, fed by the servicer as outputs arrive."""

    request_id: str
    method: str
    started: float = field(default_factory=time.monotonic)
    model: str = ""
    prompt_tokens: int = 0
    first_output: float | None = None
    output_tokens: dict[int, int] = field(default_factory=dict)
    finish_reasons: dict[int, str] = field(default_factory=dict)
    times: dict[int, Any] = field(default_factory=dict)  # completion index -> RequestTimes
    status: str = "OK"
    params: Any = None

    def prepared(self, model: str, prompt: list[int], params: Any) -> None:
        self.model, self.prompt_tokens, self.params = model, len(prompt), params

    def output(self, output: Any) -> None:
        """One delta RequestOutput of the engine."""
        for completion in output.outputs:
            if completion.token_ids and self.first_output is None:
                self.first_output = time.monotonic()
            index = completion.index
            self.output_tokens[index] = self.output_tokens.get(index, 0) + len(completion.token_ids)
            if completion.finish_reason is not None:
                self.finish_reasons[index] = completion.finish_reason
            if getattr(completion, "times", None) is not None:
                self.times[index] = completion.times

    @property
    def completion_tokens(self) -> int:
        return sum(self.output_tokens.values())

    def log_completion(self) -> None:
        now = time.monotonic()
        ttft = None if self.first_output is None else self.first_output - self.started
        reasons = ",".join(self.finish_reasons[i] for i in sorted(self.finish_reasons)) or None
        fields = {"request_id": self.request_id, "rpc": self.method, "model": self.model, "status": self.status,
                  "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                  "ttft_s": None if ttft is None else round(ttft, 6), "total_s": round(now - self.started, 6),
                  "finish_reason": reasons}
        log.info("request %s %s: model=%s prompt_tokens=%d completion_tokens=%d ttft=%s total=%.3fs "
                 "finish_reason=%s", self.request_id, self.status, self.model, self.prompt_tokens,
                 self.completion_tokens, "-" if ttft is None else f"{ttft:.3f}s", now - self.started, reasons,
                 extra={"fields": fields})


def _metadata_value(metadata: Any, key: str) -> str | None:
    for name, value in metadata or ():
        if name == key and isinstance(value, str):
            return value
    return None


@contextlib.contextmanager
def observe_rpc(method: str, request: Any, context: grpc.aio.ServicerContext, tracer: Tracer | None,
                clock: tracing.MonotonicClock) -> Iterator[RpcRecord]:
    """Name the request (its request_id, else the `x-request-id` metadata, else a new id, written
    back into `request` so that the engine uses it too), tag log lines with it, continue the
    caller's W3C trace in a server span, and log the outcome once at the end."""
    metadata = context.invocation_metadata()
    request_id = request.request_id or _metadata_value(metadata, "x-request-id") or uuid.uuid4().hex
    request.request_id = request_id
    record = RpcRecord(request_id, method)
    span = None
    if tracer is not None:
        span = tracer.start_span(f"{_SERVICE}/{method}", context=tracing.extract(metadata or ()),
                                 kind=SpanKind.SERVER,
                                 attributes={"rpc.system": "grpc", "rpc.service": _SERVICE, "rpc.method": method,
                                             tracing.REQUEST_ID: request_id})
    scope = trace.use_span(span, end_on_exit=False) if span is not None else contextlib.nullcontext()
    with request_id_set(request_id), scope:
        try:
            yield record
        except BaseException as error:
            record.status = _status_name(error, context)
            raise
        finally:
            if span is not None:
                _end_server_span(span, record, tracer, clock)
            record.log_completion()


def _status_name(error: BaseException, context: grpc.aio.ServicerContext) -> str:
    if isinstance(error, grpc.aio.AbortError):
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    return "CANCELLED" if isinstance(error, asyncio.CancelledError) else "UNKNOWN"


def _end_server_span(span: Any, record: RpcRecord, tracer: Tracer, clock: tracing.MonotonicClock) -> None:
    params = record.params
    attributes: dict[str, Any] = {
        tracing.INPUT_TOKENS: record.prompt_tokens, tracing.OUTPUT_TOKENS: record.completion_tokens,
        tracing.RESPONSE_ID: record.request_id, "rpc.grpc.status_code": getattr(grpc.StatusCode, record.status).value[0]}
    if record.model:
        attributes[tracing.MODEL] = record.model
    if params is not None:
        attributes[tracing.TEMPERATURE] = params.temperature
        attributes[tracing.TOP_P] = params.top_p
        if params.max_tokens is not None:
            attributes[tracing.MAX_TOKENS] = params.max_tokens
    if record.finish_reasons:
        attributes[tracing.FINISH_REASONS] = [record.finish_reasons[i] for i in sorted(record.finish_reasons)]
    if record.first_output is not None:
        attributes[tracing.TIME_TO_FIRST_TOKEN] = record.first_output - record.started
    first = record.times.get(0)
    if first is not None and first.scheduled is not None:
        attributes[tracing.TIME_IN_QUEUE] = first.scheduled - first.queued
    span.set_attributes(attributes)
    if record.status != "OK":
        span.set_status(Status(StatusCode.ERROR, record.status))
    for index in sorted(record.times):
        tracing.record_engine_span(tracer, span, clock, record.times[index], index=index,
                                   prompt_tokens=record.prompt_tokens,
                                   output_tokens=record.output_tokens.get(index, 0),
                                   finish_reason=record.finish_reasons.get(index))
    span.end()
