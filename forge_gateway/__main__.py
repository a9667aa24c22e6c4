"""`python -m forge_gateway --target HOST:PORT`: the OpenAI gateway alone. Flags override FORGE_*."""
from __future__ import annotations

import argparse
import sys

from forge_gateway.config import GatewayConfig, gateway_config_from_env

FLAGS = [
    ("--target", "target", str, "the Forge gRPC service, HOST:PORT"),
    ("--host", "host", str, "address to bind"),
    ("--port", "http_port", int, "HTTP port"),
    ("--api-key", "api_key", str, "require `Authorization: Bearer <key>`"),
    ("--log-level", "log_level", str, "debug, info, warning or error"),
    ("--request-timeout-s", "request_timeout_s", float, "gRPC deadline when the client sends none"),
    ("--retry-after-s", "retry_after_s", int, "Retry-After on 429 and 503"),
    ("--log-format", "log_format", str, "text, or json: one object per line with request and trace ids"),
    ("--otlp-traces-endpoint", "otlp_traces_endpoint", str,
     "OTLP/gRPC endpoint for traces (default: OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; unset: no tracing)"),
]


def parse_config(argv: list[str] | None = None) -> GatewayConfig:
    parser = argparse.ArgumentParser(prog="python -m forge_gateway", description="Forge OpenAI-compatible gateway")
    for flag, dest, kind, help_text in FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)
    return gateway_config_from_env(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from forge_gateway.app import create_app
    from forge_service.logs import setup_logging, uvicorn_log_config
    from forge_service.tracing import traced

    config = parse_config(argv)
    setup_logging(config.log_level, config.log_format)
    with traced(config.otlp_traces_endpoint, "forge-gateway") as tracer:
        uvicorn.run(create_app(config, tracer=tracer), host=config.host, port=config.http_port,
                    log_level=config.log_level, log_config=uvicorn_log_config(config.log_format),
                    timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
