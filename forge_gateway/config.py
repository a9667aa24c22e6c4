"""The gateway's configuration: one frozen dataclass, read from FORGE_* variables and flags."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from forge_service.config import from_env


@dataclass(frozen=True)
class GatewayConfig:
    # The Forge gRPC service, HOST:PORT.
    target: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    http_port: int = 8000
    # When set, every /v1 endpoint requires `Authorization: Bearer <api_key>`.
    api_key: str | None = None
    log_level: str = "info"
    # "text" or "json" (one object per line, with the request id and trace ids).
    log_format: str = "text"
    # OTLP/gRPC endpoint for traces; unset: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else tracing is off.
    otlp_traces_endpoint: str | None = None
    # gRPC deadline for a request whose client sends no `X-Request-Timeout` header (seconds).
    request_timeout_s: float = 600.0
    # Retry-After (seconds) on 429 and 503 answers.
    retry_after_s: int = 1


def gateway_config_from_env(env: Mapping[str, str] | None = None, **overrides: Any) -> GatewayConfig:
    """GatewayConfig from FORGE_<FIELD> variables (FORGE_TARGET, FORGE_HTTP_PORT, ...) and overrides."""
    return from_env(GatewayConfig, env, **overrides)
