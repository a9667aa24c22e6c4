"""Protection of the gRPC port: an API key checked on every call but health checks, and TLS/mTLS.

A call must carry metadata `authorization: Bearer <key>`; without it, or with another key, it is
refused UNAUTHENTICATED before its request is even parsed. grpc.health.v1 and forge.v1.Forge/Health
stay open so that load balancers and Kubernetes probes need no secret.
"""
from __future__ import annotations

import inspect
import secrets
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc

from forge_service.config import ServiceConfig, api_keys

# Methods any caller may use: liveness and readiness probes.
OPEN_METHODS = frozenset({
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/forge.v1.Forge/Health",
})
_MISSING = "missing API key: send gRPC metadata `authorization: Bearer <key>`"
_WRONG = "incorrect API key"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without `authorization: Bearer <key>` (OPEN_METHODS excepted)."""

    def __init__(self, keys: tuple[str, ...], open_methods: frozenset[str] = OPEN_METHODS) -> None:
        """`keys`: any of them is accepted (a list, while one is being rotated)."""
        self._keys = [key.encode() for key in keys]
        self._open = open_methods

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[grpc.RpcMethodHandler]],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method in self._open:
            return handler
        problem = self._problem(details.invocation_metadata or ())
        return handler if problem is None else refusing(handler, grpc.StatusCode.UNAUTHENTICATED, problem)

    def _problem(self, metadata: Any) -> str | None:
        values = [value for key, value in metadata if key == "authorization"]
        if not values:
            return _MISSING
        value = values[0] if isinstance(values[0], str) else values[0].decode("latin-1")
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return _MISSING
        sent = token.strip().encode()
        return None if any([secrets.compare_digest(sent, key) for key in self._keys]) else _WRONG


def refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers `code` without parsing the request."""
    original = next(fn for fn in (handler.unary_unary, handler.unary_stream, handler.stream_unary,
                                  handler.stream_stream) if fn is not None)

    if inspect.isasyncgenfunction(original):
        async def refuse_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, details)
            yield  # an async generator, like the handler it stands for

        behavior: Any = refuse_stream
    else:
        async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(code, details)

        behavior = refuse
    kind = next(name for name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
                if getattr(handler, name) is not None)
    return handler._replace(request_deserializer=None, **{kind: behavior})


def server_credentials(config: ServiceConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port from --tls-cert/--tls-key (and --tls-client-ca for mTLS); None: plaintext."""
    if config.tls_cert is None and config.tls_key is None:
        if config.tls_client_ca:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key")
        return None
    if not (config.tls_cert and config.tls_key):
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    pair = (_read(config.tls_key, "--tls-key"), _read(config.tls_cert, "--tls-cert"))
    client_ca = _read(config.tls_client_ca, "--tls-client-ca") if config.tls_client_ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca, require_client_auth=client_ca is not None)


def interceptors(config: ServiceConfig) -> list[grpc.aio.ServerInterceptor]:
    keys = api_keys(config.grpc_key, "grpc_api_key")
    return [ApiKeyInterceptor(keys)] if keys else []


def reflection_enabled(config: ServiceConfig) -> bool:
    """Reflection is served on an open port, and on a protected one only when asked for (behind the key)."""
    return config.grpc_key is None or config.enable_reflection


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"{flag}: cannot read {path}: {error.strerror}") from error
