"""Logging set-up: text or JSON lines, each line tagged with its request id and trace ids.

The request id lives in a context variable that the gateway's middleware and the servicer set
for the duration of a request, so every log line written while handling it carries the id.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Any, Iterator

from opentelemetry import trace

REQUEST_ID: ContextVar[str | None] = ContextVar("forge_request_id", default=None)
LOG_FORMATS = ("text", "json")
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"


@contextlib.contextmanager
def request_id_set(request_id: str) -> Iterator[None]:
    """Log lines written inside carry `request_id`."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


class _ContextFilter(logging.Filter):
    """Adds request_id, trace_id and span_id (None when unknown) to every record. uvicorn's server
    lines come from its logger `uvicorn.error` whatever their level ("Started server process" at
    INFO); they are shown as `uvicorn`'s, so that an INFO line never reads as an error."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "uvicorn.error":  # uvicorn's server lines, of every level, under a historical name
            record.name = "uvicorn"
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        record.request_id = request_id
        record.request_tag = f" [{request_id}]" if request_id else ""
        span = trace.get_current_span().get_span_context()
        record.trace_id = format(span.trace_id, "032x") if span.is_valid else None
        record.span_id = format(span.span_id, "016x") if span.is_valid else None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line. (The stdlib has no JSON formatter; this one is a dict and a dump.)"""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "timestamp": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "trace_id", "span_id"):
            if getattr(record, key, None):
                entry[key] = getattr(record, key)
        entry.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


def log_format(value: str) -> str:
    """argparse type of --log-format."""
    if value not in LOG_FORMATS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_FORMATS)}, not {value!r}")
    return value


def setup_logging(level: str, fmt: str = "text") -> None:
    """Root logging to stderr in `fmt` ("text" or "json"); warnings.warn goes there too. gRPC's C
    core writes its own lines to stderr, past Python's logging and in its own format (at shutdown
    under load: `I... chttp2_transport.cc] ... Got goaway`, a line that is not JSON); unless
    GRPC_VERBOSITY says otherwise, it writes only its errors. The core reads that variable when
    grpc is imported, so servers call this first."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}; got {fmt!r}")
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    handler = logging.StreamHandler()
    handler.addFilter(_ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    logging.captureWarnings(True)


# uvicorn's `log_config`: none of its own, so that its loggers (its server lines and one access line
# per HTTP request) reach the root handler and read like Forge's lines, in text mode as in JSON:
# a timestamp, and the request id of the request they are about.
UVICORN_LOG_CONFIG: dict[str, Any] | None = None
