"""`forge serve`: the gRPC service and the OpenAI gateway in one process and one event loop.

The gateway reaches the service over loopback gRPC, exactly as it would across machines.
On SIGTERM the service drains first (the gateway answers 503 to new work meanwhile), then the
gateway and the gRPC server stop.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import tempfile
from typing import Iterator

import uvicorn

from forge_gateway.app import create_app, listen_http
from forge_gateway.config import GatewayConfig, gateway_config_from_env
from forge_service.config import EngineConfig, ServiceConfig, malloc_arenas
from forge_service.logs import UVICORN_LOG_CONFIG
from forge_service.metrics import metrics_endpoint
from forge_service.server import ForgeService, build_service, cap_malloc_arenas
from forge_service.tracing import traced

log = logging.getLogger(__name__)
# How long uvicorn waits for open HTTP connections once the service has drained.
_HTTP_GRACE_S = 5
# The one replica is in this process: waiting for it to become ready would only delay the 503.
_READY_TIMEOUT_S = 0.0


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling: ForgeService.run owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def gateway_config(service_config: ServiceConfig, grpc_port: int, local_socket: str | None = None) -> GatewayConfig:
    target_host = "127.0.0.1" if service_config.host in ("0.0.0.0", "::", "") else service_config.host
    target = f"unix:{local_socket}" if local_socket else f"{target_host}:{grpc_port}"
    # FORGE_* variables set the gateway's own options (its limits among them); the service's flags win.
    return gateway_config_from_env(target=target, host=service_config.host,
                                   http_port=service_config.http_port, api_key=service_config.api_key,
                                   grpc_api_key=service_config.grpc_key, log_level=service_config.log_level,
                                   log_format=service_config.log_format, ready_timeout_s=_READY_TIMEOUT_S)


async def run_all_async(service: ForgeService, service_config: ServiceConfig,
                        stop: asyncio.Event | None = None) -> None:
    """Start `service` and a gateway in front of it; return after SIGTERM/SIGINT (or `stop`) and a drain.

    With TLS on the gRPC port the gateway reaches the service over a Unix socket in a private directory.
    The gateway traces with the service's tracer."""
    with contextlib.ExitStack() as stack:
        http_socket = stack.enter_context(listen_http(service_config.host, service_config.http_port))
        local_socket = None
        if service_config.tls_cert:
            local_socket = os.path.join(stack.enter_context(tempfile.TemporaryDirectory(prefix="forge-")), "grpc.sock")
        port = await service.start(local_socket)
        await _serve_with_gateway(service, gateway_config(service_config, port, local_socket), http_socket, stop)


async def _serve_with_gateway(service: ForgeService, config: GatewayConfig, http_socket: socket.socket,
                              stop: asyncio.Event | None) -> None:
    http = _Uvicorn(uvicorn.Config(create_app(config, tracer=service.tracer), host=config.host,
                                   port=config.http_port, log_level=config.log_level,
                                   log_config=UVICORN_LOG_CONFIG,
                                   timeout_graceful_shutdown=_HTTP_GRACE_S))
    gateway = asyncio.create_task(http.serve(sockets=[http_socket]))
    try:
        await service.run(stop)  # loads, serves, and on a signal drains and stops the gRPC server
    finally:
        http.should_exit = True
        await gateway


def run_all(engine_config: EngineConfig, service_config: ServiceConfig) -> None:
    """Run the gRPC service and the gateway until SIGTERM/SIGINT; returns after a clean drain.
    The service's metrics are on --metrics-port, the gateway's on its HTTP port."""
    cap_malloc_arenas(malloc_arenas())
    with traced(service_config.otlp_traces_endpoint, "forge") as tracer:
        service = build_service(engine_config, service_config, tracer)
        with metrics_endpoint(service.metrics.registry, service_config.host, service_config.metrics_port):
            asyncio.run(run_all_async(service, service_config))
