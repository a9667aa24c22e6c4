"""`python -m forge_gateway --target HOST:PORT`: the OpenAI gateway alone. Flags override FORGE_*."""
from __future__ import annotations

import argparse
import logging
import sys

from forge_gateway.config import GatewayConfig, gateway_config_from_env

FLAGS = [
    ("--target", "target", str, "the Forge gRPC service: HOST:PORT, HOST:PORT,HOST:PORT,... or dns:///NAME:PORT"),
    ("--host", "host", str, "address to bind"),
    ("--port", "http_port", int, "HTTP port"),
    ("--api-key", "api_key", str, "require `Authorization: Bearer <key>`"),
    ("--log-level", "log_level", str, "debug, info, warning or error"),
    ("--request-timeout-s", "request_timeout_s", float, "gRPC deadline when the client sends none"),
    ("--retry-after-s", "retry_after_s", int, "Retry-After on 429 and 503"),
    ("--ready-timeout-s", "ready_timeout_s", float, "how long a request waits for a ready replica before 503"),
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
