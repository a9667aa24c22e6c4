"""The gateway's configuration: one frozen dataclass, read from FORGE_* variables and flags."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from forge_service.config import api_keys, from_env, require_at_least, require_ports, require_positive


@dataclass(frozen=True)
class GatewayConfig:
    # The Forge gRPC service: HOST:PORT, a comma-separated list of them (one per replica), or a
    # gRPC target URI such as dns:///forge-service-headless:50051 (every address the name has).
    target: str = "127.0.0.1:50051"
    host: str = "127.0.0.1"
    http_port: int = 8000
    # When set, every path but /health requires `Authorization: Bearer <api_key>`.
    api_key: str | None = None
    log_level: str = "info"
    # "text" or "json" (one object per line, with the request id and trace ids).
    log_format: str = "text"
    # OTLP/gRPC endpoint for traces; unset: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT, else tracing is off.
    otlp_traces_endpoint: str | None = None
    # gRPC deadline for a request whose client sends no `X-Request-Timeout` header (seconds).
    request_timeout_s: float = 600.0
    # ---- limits on one request (README "Gateway limits"); each refusal is OpenAI error JSON ----
    # Request body, checked from Content-Length and while it arrives: 413 before it is all read.
    max_body_bytes: int = 4 << 20
    # Nesting of arrays and objects in the JSON body (a JSON Schema counts too): 400.
    max_json_depth: int = 64
    # Fields the API does not define are ignored up to this many bytes of JSON in all (keys and values): 400.
    max_unknown_field_bytes: int = 64 << 10
    # Prompts in one /v1/completions batch (each is one gRPC call): 400.
    max_prompts: int = 64
    # Messages in one chat request: 400.
    max_messages: int = 1024
    # Entries in `stop`, and in `stop_token_ids`: 400.
    max_stop: int = 16
    # Characters in one stop string (the service holds back that much streamed text): 400.
    max_stop_chars: int = 1024
    # Completions per prompt (`n`): 400.
    max_n: int = 16
    # n x max_tokens x prompts, the tokens one request may ask for (when max_tokens is given): 400.
    max_n_tokens: int = 1 << 18
    # Entries in `logit_bias`: 400.
    max_logit_bias: int = 1024

    # Retry-After (seconds) on 429 and 503 answers.
    retry_after_s: int = 1
    # How to dial the service: its API key (sent as `authorization: Bearer`), the CA that signed its
    # TLS certificate (set: TLS), a client certificate and key for mTLS, and the name its certificate
    # carries when that is not the target's host. The key defaults to api_key, as the service's does.
    grpc_api_key: str | None = None
    grpc_ca_file: str | None = None
    grpc_client_cert: str | None = None
    grpc_client_key: str | None = None
    grpc_server_name: str | None = None
    # How long a request waits for a ready replica (none ready: all loading, draining or gone)
    # before the gateway answers 503.
    ready_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        require_ports(self, "http_port")
        api_keys(self.api_key, "api_key")
        api_keys(self.grpc_api_key, "grpc_api_key")
        require_at_least(self, 0, "retry_after_s", "ready_timeout_s")
        require_at_least(self, 1, "max_body_bytes", "max_json_depth", "max_prompts", "max_messages", "max_n")
        require_at_least(self, 0, "max_unknown_field_bytes", "max_stop", "max_stop_chars", "max_n_tokens",
                         "max_logit_bias")
        require_positive(self, "request_timeout_s")


def gateway_config_from_env(env: Mapping[str, str] | None = None, **overrides: Any) -> GatewayConfig:
    """GatewayConfig from FORGE_<FIELD> variables (FORGE_TARGET, FORGE_HTTP_PORT, ...) and overrides."""
    return from_env(GatewayConfig, env, **overrides)
