"""Requests that cannot be parsed (invalid UTF-8 in a string field, truncated bytes) get
INVALID_ARGUMENT with the parser's reason.

gRPC parses a request before its handler runs, and a parse error there would reach the client as
UNKNOWN. The guard wraps each handler's parser so that a failure becomes a value the handler
answers with INVALID_ARGUMENT.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc
from google.protobuf.message import DecodeError

from forge_service.errors import bounded_details


@dataclass(frozen=True)
class _Undecodable:
    reason: str


class UndecodableRequestGuard(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT to a unary request that does not parse as its message type."""

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        kind = "unary_stream" if handler.response_streaming else "unary_unary"
        return handler._replace(request_deserializer=_tolerant(handler.request_deserializer),
                                **{kind: _checked(getattr(handler, kind))})


def _tolerant(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as error:
            return _Undecodable(str(error) or "malformed message")

    return deserialize


def _checked(behavior: Callable[..., Any]) -> Callable[..., Any]:
    async def refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bounded_details(
            f"the request does not parse ({request.reason}); string fields must be valid UTF-8"))

    if inspect.isasyncgenfunction(behavior):
        async def checked_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await refuse(request, context)
            async for response in behavior(request, context):
                yield response

        return checked_stream

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await refuse(request, context)
        return await behavior(request, context)

    return checked
