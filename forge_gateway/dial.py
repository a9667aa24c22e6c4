"""The gateway's channel to the Forge service: plaintext or TLS (mTLS with a client certificate),
with the service's API key sent as `authorization: Bearer <key>` on every call."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import grpc

from forge_gateway.config import GatewayConfig
from forge_service.config import api_keys


def _with_key(details: grpc.aio.ClientCallDetails, header: tuple[str, str]) -> grpc.aio.ClientCallDetails:
    return details._replace(metadata=grpc.aio.Metadata(*(details.metadata or ()), header))  # type: ignore[attr-defined]


# Two classes: a channel files each interceptor under one kind of call only.
class _UnaryKey(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds the API key to each call's metadata (works on plaintext channels, unlike call credentials)."""

    def __init__(self, key: str) -> None:
        self.header = ("authorization", f"Bearer {key}")

    async def intercept_unary_unary(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                    request: Any) -> Any:
        return await continuation(_with_key(details, self.header), request)


class _StreamKey(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, key: str) -> None:
        self.header = ("authorization", f"Bearer {key}")

    async def intercept_unary_stream(self, continuation: Any, details: grpc.aio.ClientCallDetails,
                                     request: Any) -> Any:
        return await continuation(_with_key(details, self.header), request)


def channel_credentials(config: GatewayConfig) -> grpc.ChannelCredentials | None:
    """TLS credentials from --grpc-ca-file and --grpc-client-cert/--grpc-client-key; None: plaintext."""
    if not (config.grpc_ca_file or config.grpc_client_cert or config.grpc_client_key):
        return None
    if bool(config.grpc_client_cert) != bool(config.grpc_client_key):
        raise ValueError("--grpc-client-cert and --grpc-client-key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(config.grpc_ca_file) if config.grpc_ca_file else None,  # None: system roots
        private_key=_read(config.grpc_client_key) if config.grpc_client_key else None,
        certificate_chain=_read(config.grpc_client_cert) if config.grpc_client_cert else None)


def open_channel(config: GatewayConfig, options: Sequence[tuple[str, Any]] = (),
                 interceptors: Sequence[Any] = ()) -> grpc.aio.Channel:
    """A channel to config.target as the configuration says (TLS, client certificate, API key);
    `interceptors` run on every call before the key is added."""
    # As the service defaults; of a list of keys, the first (the others are accepted, not presented).
    key = next(iter(api_keys(config.api_key if config.grpc_api_key is None else config.grpc_api_key)), None)
    interceptors = [*interceptors, *([_UnaryKey(key), _StreamKey(key)] if key else [])] or None
    options = list(options)
    if config.grpc_server_name:
        options.append(("grpc.ssl_target_name_override", config.grpc_server_name))
    credentials = channel_credentials(config)
    if credentials is None:
        return grpc.aio.insecure_channel(config.target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(config.target, credentials, options=options, interceptors=interceptors)


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read {path}: {error.strerror}") from error
