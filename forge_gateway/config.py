"""The gateway's configuration: one frozen dataclass, read from FORGE_* variables and flags."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from forge_service.config import from_env


@dataclass(frozen=True)
class GatewayConfig:
    # The Forge gRPC service: HOST:PORT, a comma-separated list of them (one per replica), or a
    # gRPC target URI such as dns:///forge-service-headless:50051 (every address the name has).
    target: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    http_port: int = 8000
    # When set, every /v1 endpoint requires `Authorization: Bearer <api_key>`.
    api_key: str | None = None
    log_level: str = "info"
    # gRPC deadline for a request whose client sends no `X-Request-Timeout` header (seconds).
    request_timeout_s: float = 600.0
    # Retry-After (seconds) on 429 and 503 answers.
    retry_after_s: int = 1
    # How long a request waits for a ready replica (none ready: all loading, draining or gone)
    # before the gateway answers 503.
    ready_timeout_s: float = 5.0


def gateway_config_from_env(env: Mapping[str, str] | None = None, **overrides: Any) -> GatewayConfig:
    """GatewayConfig from FORGE_<FIELD> variables (FORGE_TARGET, FORGE_HTTP_PORT, ...) and overrides."""
    return from_env(GatewayConfig, env, **overrides)
