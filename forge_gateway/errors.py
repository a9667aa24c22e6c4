"""OpenAI-shaped errors, and the one table that maps gRPC status codes to HTTP."""
from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any

import grpc
from fastapi.responses import JSONResponse

from forge_service.errors import ERROR_FIELD_KEY, ERROR_KIND_KEY, QUEUE_FULL

log = logging.getLogger(__name__)

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code).
GRPC_TO_HTTP: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", QUEUE_FULL),
    grpc.StatusCode.CANCELLED: (499, "cancelled", None),
    grpc.StatusCode.UNIMPLEMENTED: (501, "invalid_request_error", "not_implemented"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout", "deadline_exceeded"),
    grpc.StatusCode.INTERNAL: (500, "server_error", None),
    grpc.StatusCode.UNKNOWN: (500, "server_error", None),
    grpc.StatusCode.DATA_LOSS: (500, "server_error", None),
    grpc.StatusCode.ABORTED: (500, "server_error", None),
}
_RETRY_STATUSES = (429, 503)
# RESOURCE_EXHAUSTED is a 429 only when the service marks it as its full queue in this trailing
# metadata; otherwise it is a size bound (a message over gRPC's limit), which no retry can pass.


class GatewayError(Exception):
    """An error answered in OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self, retry_after_s: int = 1, headers: Mapping[str, str] | None = None) -> JSONResponse:
        """The OpenAI error JSON; `headers` go with it (a 405's Allow)."""
        headers = dict(headers or {})
        if self.status in _RETRY_STATUSES:
            headers["Retry-After"] = str(retry_after_s)
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)


# GenerateRequest fields whose OpenAI parameter has another name (sampling.* and stopping.* keep
# theirs; chat.messages[i]... is messages[i]...).
_PARAMS = {"text": "prompt", "token_ids": "prompt", "chat": "messages", "json_schema": "response_format",
           "json_object": "response_format", "regex": "guided_regex", "choice": "guided_choice",
           "grammar": "guided_grammar", "structural_tag": "response_format"}


def openai_param(field: str | None) -> str | None:
    """The OpenAI parameter of a GenerateRequest field path, as the service names it in an
    error's trailing metadata: stopping.max_tokens -> max_tokens, chat -> messages,
    chat.messages[2].content -> messages[2].content, text -> prompt."""
    if not field:
        return None
    head, rest = re.match(r"([^.\[]*)(.*)", field).groups()
    if head in ("sampling", "stopping", "chat") and rest.startswith("."):
        return rest[1:]
    return _PARAMS.get(head, head) + rest


def from_grpc(error: grpc.aio.AioRpcError) -> GatewayError:
    """The OpenAI error for a failed call: status and type by its code; param and code from the
    field and kind the service marks it with (e.g. messages, context_length_exceeded)."""
    status, type_, code = GRPC_TO_HTTP.get(error.code(), (500, "server_error", None))
    marks = dict(tuple(error.trailing_metadata() or ()))
    # The service marks its one retryable RESOURCE_EXHAUSTED, a full queue; gRPC's own (a message
    # over its size limit) cannot succeed on a retry.
    if error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and marks.get(ERROR_KIND_KEY) != QUEUE_FULL:
        status, type_, code = 413, "invalid_request_error", "request_too_large"
    return GatewayError(status, error.details() or error.code().name, type_,
                        param=openai_param(marks.get(ERROR_FIELD_KEY)), code=marks.get(ERROR_KIND_KEY) or code)


def internal_error(error: BaseException) -> GatewayError:
    """A bug in the gateway: 500 with an id that is also in the log."""
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error [error id %s]", error_id, exc_info=error)
    return GatewayError(500, f"internal error [error id {error_id}]", "server_error")


def validation_error(errors: list[dict[str, Any]]) -> GatewayError:
    """A pydantic/FastAPI validation failure (or malformed JSON) as a 400."""
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return GatewayError(400, f"malformed JSON body: {first.get('msg')}", code="invalid_json")
    param = ".".join(loc) or None
    # A model validator's ValueError comes as "Value error, <its message>": the message is the user's.
    reason = str(first["msg"]).removeprefix("Value error, ")
    message = f"{param}: {reason}" if param else reason
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return GatewayError(400, message, param=param, code="invalid_value")


def unauthorized(message: str) -> GatewayError:
    return GatewayError(401, message, "invalid_request_error", code="invalid_api_key")
