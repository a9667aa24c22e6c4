"""`python -m forge_gateway --target HOST:PORT`: the OpenAI gateway alone. Flags override FORGE_*."""
from __future__ import annotations

import argparse
import logging
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
    ("--grpc-api-key", "grpc_api_key", str, "the service's gRPC API key"),
    ("--grpc-ca-file", "grpc_ca_file", str, "PEM CA of the service's TLS certificate (dial with TLS)"),
    ("--grpc-client-cert", "grpc_client_cert", str, "PEM client certificate for mTLS"),
    ("--grpc-client-key", "grpc_client_key", str, "PEM private key of --grpc-client-cert"),
    ("--grpc-server-name", "grpc_server_name", str, "name in the service's certificate, if not the target host"),
]


def parse_config(argv: list[str] | None = None) -> GatewayConfig:
    parser = argparse.ArgumentParser(prog="python -m forge_gateway", description="Forge OpenAI-compatible gateway")
    for flag, dest, kind, help_text in FLAGS:
        parser.add_argument(flag, dest=dest, type=kind, default=None, help=help_text)
    return gateway_config_from_env(**vars(parser.parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from forge_gateway.app import create_app

    config = parse_config(argv)
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(config), host=config.host, port=config.http_port, log_level=config.log_level,
                timeout_graceful_shutdown=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
