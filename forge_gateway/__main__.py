"""`python -m forge_gateway --target HOST:PORT`: the OpenAI gateway alone. Flags override FORGE_*."""
from __future__ import annotations

import argparse
import sys

from forge_gateway.config import GatewayConfig, gateway_config_from_env
from forge_service.logs import log_format

FLAGS = [
    ("--target", "target", str, "the Forge gRPC service: HOST:PORT, HOST:PORT,HOST:PORT,... or dns:///NAME:PORT"),
    ("--host", "host", str, "address to bind"),
    ("--port", "http_port", int, "HTTP port"),
    ("--api-key", "api_key", str, "require `Authorization: Bearer <key>`; KEY[,KEY...] accepts any of them"),
    ("--log-level", "log_level", str, "debug, info, warning or error"),
    ("--request-timeout-s", "request_timeout_s", float, "gRPC deadline when the client sends none"),
    ("--retry-after-s", "retry_after_s", int, "Retry-After on 429 and 503"),
    ("--log-format", "log_format", log_format, "text, or json: one object per line with request and trace ids"),
    ("--otlp-traces-endpoint", "otlp_traces_endpoint", str,
     "OTLP/gRPC endpoint for traces (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; unset: no tracing)"),
    ("--ready-timeout-s", "ready_timeout_s", float, "how long a request waits for a ready replica before 503"),
    ("--grpc-api-key", "grpc_api_key", str, "the service's gRPC API key (of a KEY[,KEY...] list, the first)"),
    ("--grpc-ca-file", "grpc_ca_file", str, "PEM CA of the service's TLS certificate (dial with TLS)"),
    ("--grpc-client-cert", "grpc_client_cert", str, "PEM client certificate for mTLS"),
    ("--grpc-client-key", "grpc_client_key", str, "PEM private key of --grpc-client-cert"),
    ("--grpc-server-name", "grpc_server_name", str, "name in the service's certificate, if not the target host"),
]

# Limits on one request (README "Gateway limits").
LIMIT_FLAGS = [
    ("--max-body-bytes", "max_body_bytes", int, "largest request body; past it 413"),
    ("--max-json-depth", "max_json_depth", int, "deepest nesting of the JSON body; past it 400"),
    ("--max-unknown-field-bytes", "max_unknown_field_bytes", int, "JSON size of ignored unknown fields; past it 400"),
    ("--max-prompts", "max_prompts", int, "prompts in one /v1/completions batch; past it 400"),
    ("--max-messages", "max_messages", int, "messages in one chat request; past it 400"),
    ("--max-stop", "max_stop", int, "entries in stop and in stop_token_ids; past it 400"),
    ("--max-stop-chars", "max_stop_chars", int, "characters in one stop string; past it 400"),
    ("--max-n", "max_n", int, "completions per prompt (n); past it 400"),
    ("--max-n-tokens", "max_n_tokens", int, "prompts x n x max_tokens; past it 400"),
    ("--max-logit-bias", "max_logit_bias", int, "entries in logit_bias; past it 400"),
]


def parse_config(argv: list[str] | None = None) -> GatewayConfig:
    parser = argparse.ArgumentParser(prog="python -m forge_gateway", description="Forge OpenAI-compatible gateway")
    for flag, dest, kind, help_text in FLAGS + LIMIT_FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)
    args = parser.parse_args(argv)
    try:
        return gateway_config_from_env(**vars(args))
    except ValueError as error:  # a FORGE_* variable or a value out of range
        parser.error(str(error))


def main(argv: list[str] | None = None) -> int:
    from forge_service.__main__ import run_or_report
    from forge_service.logs import setup_logging

    config = parse_config(argv)
    setup_logging(config.log_level, config.log_format)
    return run_or_report(lambda: serve(config))


def serve(config: GatewayConfig) -> None:
    """Serve until SIGTERM/SIGINT. What the channels need (the target, the TLS files) and the HTTP
    port are checked first: StartupError, not a traceback from uvicorn's start."""
    import uvicorn

    from forge_gateway import balancer, dial
    from forge_gateway.app import create_app, listen_http
    from forge_service.errors import StartupError
    from forge_service.logs import UVICORN_LOG_CONFIG
    from forge_service.tracing import traced

    try:
        balancer.channel_target(config.target)  # a list's host names resolve
        dial.channel_credentials(config)  # the TLS files can be read
    except ValueError as error:
        raise StartupError(str(error)) from None
    with listen_http(config.host, config.http_port) as sock, \
            traced(config.otlp_traces_endpoint, "forge-gateway") as tracer:
        server = uvicorn.Server(uvicorn.Config(create_app(config, tracer=tracer), host=config.host,
                                               port=config.http_port, log_level=config.log_level,
                                               log_config=UVICORN_LOG_CONFIG,
                                               timeout_graceful_shutdown=30))
        server.run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
