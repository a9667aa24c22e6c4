"""Bounds on one request, checked before any of it reaches the service.

`RequestGuard` is pure ASGI and wraps the whole app, so that its answers come before FastAPI
reads or parses anything: the API key first, then the body's size (from Content-Length and while
it arrives), then the JSON's well-formedness. `check_request` bounds the validated body's sizes.
Every refusal is OpenAI error JSON; the README's "Gateway limits" table lists them.
"""
from __future__ import annotations

import json
import secrets
from typing import Any, Iterator

import numpy as np
import pydantic_core
from pydantic import BaseModel
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from forge_gateway.config import GatewayConfig
from forge_service.config import api_keys
from forge_gateway.errors import GatewayError, unauthorized
from forge_gateway.models import ChatCompletionRequest, CompletionRequest, _Common

# Probes and Prometheus reach these without the API key; everything else (the OpenAPI schema too) needs it.
PUBLIC_PATHS = frozenset({"/health", "/livez", "/metrics"})


class RequestGuard:
    """The outermost ASGI layer: authentication, body size, JSON shape; then the app, body replayed."""

    def __init__(self, app: ASGIApp, config: GatewayConfig) -> None:
        self.app, self.config = app, config
        self.keys = [key.encode() for key in api_keys(config.api_key)]  # any of them is accepted

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body, error = None, self._unauthorized(scope) or self._declared_too_large(scope)
        if error is None:
            body, error = await self._read_body(receive)
        if body and scope["method"] == "POST":
            error = check_json(body, self.config.max_json_depth)
        if error is not None:
            await _answer(error, scope, send, self.config.retry_after_s, close=body is None)
        elif body is not None:
            await self.app(scope, _replay(body, receive), send)

    def _unauthorized(self, scope: Scope) -> GatewayError | None:
        if self.config.api_key is None or scope["path"] in PUBLIC_PATHS:
            return None
        scheme, _, token = _header(scope, b"authorization").partition(" ")
        if scheme.lower() != "bearer" or not token:
            return unauthorized("missing API key: send `Authorization: Bearer <key>`")
        if not any([secrets.compare_digest(token.encode(), key) for key in self.keys]):
            return unauthorized("incorrect API key provided")
        return None

    def _declared_too_large(self, scope: Scope) -> GatewayError | None:
        declared = _header(scope, b"content-length")
        if declared.isdigit() and int(declared) > self.config.max_body_bytes:
            return body_too_large(self.config.max_body_bytes)
        return None

    async def _read_body(self, receive: Receive) -> tuple[bytes | None, GatewayError | None]:
        """The whole body, or an error as soon as it passes the bound; (None, None) if the client left."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None, None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.config.max_body_bytes:
                return None, body_too_large(self.config.max_body_bytes)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), None


def body_too_large(limit: int) -> GatewayError:
    return GatewayError(413, f"the request body is larger than the bound of {limit} bytes",
                        code="request_too_large")


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope["headers"]:
        if key.lower() == name:
            return value.decode("latin-1")
    return ""


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that gives the app the body read already, then the client's later messages."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        return pending.pop() if pending else await receive()

    return replay


async def _answer(error: GatewayError, scope: Scope, send: Send, retry_after_s: int, close: bool) -> None:
    response = error.response(retry_after_s)
    if close:  # the rest of the body is never read, so the connection cannot carry another request
        response.headers["connection"] = "close"
    await response(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


# ---- the JSON, before FastAPI parses it ----------------------------------------------
# Both checks run in compiled code (jiter, numpy): a body at the default size bound takes tens of ms.
_BRACKET_STEP = np.zeros(256, dtype=np.int8)
_BRACKET_STEP[[ord("["), ord("{")]], _BRACKET_STEP[[ord("]"), ord("}")]] = 1, -1


def check_json(body: bytes, max_depth: int) -> GatewayError | None:
    """A 400 for a body that is not UTF-8 JSON (NaN and Infinity included), holds a lone UTF-16
    surrogate (no Unicode text: it could never reach the service), or nests deeper than `max_depth`."""
    try:
        pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as error:
        message = _first_line(error)
        if "recursion limit" in message:  # jiter's own bound (200 levels)
            return _too_deep(max_depth)
        if "surrogate" in message or "end of hex escape" in message:  # jiter's words for a lone half
            return GatewayError(400, f"a string holds a lone UTF-16 surrogate, which is not Unicode text ({message})",
                                code="invalid_value")
        return GatewayError(400, f"malformed JSON body: {message}", code="invalid_json")
    return _too_deep(max_depth) if _depth(body) > max_depth else None


def _depth(body: bytes) -> int:
    """Deepest nesting of arrays and objects in valid JSON (brackets inside strings do not count)."""
    if b"\\" in body:  # drop escaped backslashes, then escaped quotes: what is left of `"` delimits strings
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    raw = np.frombuffer(body, dtype=np.uint8)
    step = _BRACKET_STEP[raw]
    step[np.logical_xor.accumulate(raw == ord('"'))] = 0  # inside a string
    step = step[step != 0]
    return int(step.cumsum(dtype=np.int32).max()) if step.size else 0


def _too_deep(max_depth: int) -> GatewayError:
    return GatewayError(400, f"the JSON body is nested deeper than {max_depth} levels", code="invalid_json")


def _first_line(error: Exception) -> str:
    return str(error).splitlines()[0][:200] if str(error) else type(error).__name__


# ---- sizes of a validated request ----------------------------------------------------

def check_request(body: ChatCompletionRequest | CompletionRequest, config: GatewayConfig) -> None:
    """Raise a 400 GatewayError when the request asks for more than the configured bounds."""
    prompts = len(body.prompts()) if isinstance(body, CompletionRequest) else 1
    messages = len(body.messages) if isinstance(body, ChatCompletionRequest) else 0  # elsewhere an unknown field
    bounds = [
        ("prompt", prompts, config.max_prompts, "prompts in one request"),
        ("messages", messages, config.max_messages, "messages"),
        ("stop", len(body.stop_list), config.max_stop, "stop strings"),
        ("stop_token_ids", len(body.stop_token_ids or ()), config.max_stop, "stop token ids"),
        ("stop", max(map(len, body.stop_list), default=0), config.max_stop_chars, "characters in a stop string"),
        ("n", body.n, config.max_n, "completions per prompt (n)"),
        ("logit_bias", len(body.logit_bias or {}), config.max_logit_bias, "logit_bias entries"),
    ]
    for param, count, bound, what in bounds:
        if count > bound:
            raise GatewayError(400, f"{param}: {count} {what} exceed the bound of {bound}", param=param,
                               code="limit_exceeded")
    _check_n_tokens(body, prompts, config.max_n_tokens)
    check_unknown_fields(body, config.max_unknown_field_bytes)


def _check_n_tokens(body: _Common, prompts: int, bound: int) -> None:
    max_tokens = body.output_limit if isinstance(body, ChatCompletionRequest) else body.max_tokens
    if max_tokens is not None and prompts * body.n * max_tokens > bound:
        raise GatewayError(
            400, f"max_tokens: {prompts} prompt(s) x n={body.n} x max_tokens={max_tokens} = "
                 f"{prompts * body.n * max_tokens} tokens exceed the bound of {bound}",
            param="max_tokens", code="limit_exceeded")


def check_unknown_fields(body: BaseModel, bound: int) -> None:
    """Unknown fields are ignored while they stay small: a client may send newer OpenAI parameters,
    but megabytes of them would be parsed and held for nothing."""
    size, names = 0, []
    for path, value in _unknown_fields(body, ""):
        names.append(path)
        size += len(path) + len(json.dumps(value))
        if size > bound:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise GatewayError(400, f"unknown fields ({shown}) hold more than {bound} bytes; remove them",
                               param=names[0], code="unknown_fields")


def _unknown_fields(value: Any, path: str) -> Iterator[tuple[str, Any]]:
    if isinstance(value, BaseModel):
        for key, extra in (value.__pydantic_extra__ or {}).items():
            yield path + key, extra
        for name in type(value).model_fields:
            yield from _unknown_fields(getattr(value, name), f"{path}{name}.")
    elif isinstance(value, list) and value and isinstance(value[0], BaseModel):  # not into token ids
        for i, item in enumerate(value):
            yield from _unknown_fields(item, f"{path}{i}.")
