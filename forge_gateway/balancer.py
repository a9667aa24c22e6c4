"""The gateway's channels to the service replicas: gRPC's own client-side balancing and health.

One target may name many replicas: `dns:///forge-service-headless:50051` (every address the
name resolves to, re-resolved as pods come and go) or a comma-separated list of addresses.
The work channel balances per call with `round_robin` over the replicas whose
grpc.health.v1 readiness ("forge.v1.Forge") is SERVING, and retries UNAVAILABLE for calls that
never reached a replica (a replica sends its response headers when it admits a call, which
commits the call). A second channel without health checking asks a replica that is not ready
why it is not (loading, draining), for /health and for the 503 that follows.
"""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import socket
from dataclasses import dataclass, replace
from typing import Any, AsyncIterator, Sequence

import grpc

from forge_gateway import dial
from forge_gateway.config import GatewayConfig
from forge_gateway.errors import GatewayError
from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc

READINESS_SERVICE = pb.DESCRIPTOR.services_by_name["Forge"].full_name  # "forge.v1.Forge"
_MESSAGE_LIMITS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
# Dead connections (a node gone without a FIN) are found within keepalive_time + keepalive_timeout;
# a replica that comes back is reconnected within max_reconnect_backoff.
_CONNECTION_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5_000),
    ("grpc.dns_min_time_between_resolutions_ms", 5_000),
    # The service config below is the gateway's; DNS TXT records must not replace it.
    ("grpc.service_config_disable_resolution", 1),
]
# UNAVAILABLE before a replica admitted the call: it was refused while draining, or its
# connection died first. Five attempts (gRPC's most) since round_robin may pick the same replica
# twice. Throttled: once about 50 more calls have failed than a fifth of those that succeeded,
# retries stop, so that a fleet that is down is not hammered.
# How often a call waiting for its first replica looks at the channel's state.
_POLL_S = 0.05
RETRY_POLICY = {"maxAttempts": 5, "initialBackoff": "0.1s", "maxBackoff": "1s", "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"]}


def service_config(work: bool = True) -> dict[str, Any]:
    """The gRPC service config: round_robin; for the work channel also client-side health
    checking, waitForReady (bounded by Replicas.admitted) and retries. The probe channel fails fast."""
    config: dict[str, Any] = {"loadBalancingConfig": [{"round_robin": {}}]}
    if work:
        config["healthCheckConfig"] = {"serviceName": READINESS_SERVICE}
        config["methodConfig"] = [{"name": [{"service": READINESS_SERVICE}], "waitForReady": True,
                                   "retryPolicy": RETRY_POLICY}]
        config["retryThrottling"] = {"maxTokens": 100, "tokenRatio": 0.1}
    return config


def channel_options(work: bool = True) -> list[tuple[str, Any]]:
    return [*_MESSAGE_LIMITS, *_CONNECTION_OPTIONS, ("grpc.service_config", json.dumps(service_config(work)))]


def channel_target(target: str) -> str:
    """A gRPC target for `target`: a URI (`dns:///name:port`, `ipv4:...`) or one HOST:PORT is kept;
    a comma-separated list of HOST:PORT becomes one `ipv4:`/`ipv6:` target that round_robin
    spreads over. Host names in a list are resolved once, here (use `dns:///` for names whose
    addresses change)."""
    parts = [part.strip() for part in target.split(",") if part.strip()]
    if not parts:
        raise ValueError("the target is empty: give HOST:PORT, a comma-separated list of them, or dns:///NAME:PORT")
    if len(parts) == 1:
        return parts[0]
    addresses = [_numeric(part) for part in parts]
    families = {":" in host for host, _ in addresses}
    if len(families) > 1:
        raise ValueError(f"target {target!r} mixes IPv4 and IPv6 addresses; use one family")
    if families == {True}:
        return "ipv6:" + ",".join(f"[{host}]:{port}" for host, port in addresses)
    return "ipv4:" + ",".join(f"{host}:{port}" for host, port in addresses)


def _numeric(address: str) -> tuple[str, int]:
    """(IP literal, port) of HOST:PORT or [V6]:PORT; a host name is resolved (first address)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "/" in address:
        raise ValueError(f"{address!r} in the target list is not HOST:PORT")
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host)), int(port)
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ValueError(f"cannot resolve {host!r} in the target list: {error}") from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # IPv4 first, as most lists are
    return str(infos[0][4][0]), int(port)


# Generate's full name on the wire, which says nothing of how many messages each side sends.
_GENERATE = f"/{READINESS_SERVICE}/Generate"


@dataclass
class Replicas:
    """The stubs the routes use, and the bounded wait for a replica to admit a call."""

    work: pb_grpc.ForgeStub
    probe: pb_grpc.ForgeStub
    channel: grpc.aio.Channel
    ready_timeout_s: float

    def generate(self, request: pb.GenerateRequest, timeout: float) -> grpc.aio.UnaryStreamCall:
        """Generate on the work channel, called as a server stream of its one response.

        grpc.aio hands a unary call's response headers over only with its response, so `admitted`
        could not tell a call a replica is running from one still waiting for a ready replica,
        and would cancel a long generation whose replica began draining. As a stream, the headers
        come when the replica admits the call. `one_response` reads the answer."""
        call = self.channel.unary_stream(_GENERATE, request_serializer=pb.GenerateRequest.SerializeToString,
                                         response_deserializer=pb.GenerateResponse.FromString)
        return call(request, timeout=timeout)

    async def admitted(self, calls: Sequence[Any]) -> None:
        """Wait until a replica has admitted each call (its response headers came, or it ended).

        A call waits for a ready replica (waitForReady); once the channel has been failing (no
        replica ready or reachable) for ready_timeout_s, the calls are cancelled and the answer
        is 503. While it connects (at start, or after a replica closed an old connection) the
        call waits; connecting ends in READY or in failing within gRPC's connect timeout."""
        loop = asyncio.get_running_loop()
        for call in calls:
            headers = asyncio.ensure_future(call.initial_metadata())
            failing_since: float | None = None
            while not (await asyncio.wait({headers}, timeout=_POLL_S))[0]:
                state = self.channel.get_state()
                if state is grpc.ChannelConnectivity.READY:
                    failing_since = None  # dispatched to a replica (or retrying): its own deadline holds
                elif state is grpc.ChannelConnectivity.TRANSIENT_FAILURE and failing_since is None:
                    failing_since = loop.time()
                if failing_since is not None and loop.time() - failing_since >= self.ready_timeout_s:
                    headers.cancel()
                    for each in calls:
                        each.cancel()
                    raise await self.no_ready_replica()

    @staticmethod
    async def one_response(call: grpc.aio.UnaryStreamCall) -> pb.GenerateResponse:
        """The response of a `generate` call (its error status raised as AioRpcError)."""
        responses = [response async for response in call]
        if len(responses) != 1:
            raise RuntimeError(f"Generate answered {len(responses)} messages where its method sends one")
        return responses[0]

    async def no_ready_replica(self) -> GatewayError:
        """The 503 for a request that found no ready replica, saying why when one answers."""
        try:
            state = await self.probe.Health(pb.HealthRequest(), timeout=2)
            why = "the service is " + pb.ServingState.Name(state.state).removeprefix("SERVING_STATE_").lower()
        except grpc.aio.AioRpcError as error:
            why = f"no replica answers ({error.code().name})"
        return GatewayError(503, f"no ready replica: {why}; retry later",
                            "service_unavailable", code="unavailable")

    async def health(self) -> pb.HealthResponse:
        """A ready replica's Health if there is one (waiting at most ready_timeout_s), else any replica's."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._settled(), min(self.ready_timeout_s, 1.0))
        ready = self.channel.get_state() is grpc.ChannelConnectivity.READY
        return await (self.work if ready else self.probe).Health(pb.HealthRequest(), timeout=5)


    async def _settled(self) -> None:
        """Until the channel is past connecting: READY, or failing (no replica ready)."""
        state = self.channel.get_state(try_to_connect=True)
        while state in (grpc.ChannelConnectivity.IDLE, grpc.ChannelConnectivity.CONNECTING):
            await self.channel.wait_for_state_change(state)
            state = self.channel.get_state(try_to_connect=True)


@contextlib.asynccontextmanager
async def open_replicas(config: GatewayConfig, interceptors: Sequence[Any] = ()) -> AsyncIterator[Replicas]:
    """The work channel (health-checked round_robin, its calls through `interceptors`) and the
    probe channel to config.target."""
    resolved = replace(config, target=channel_target(config.target))
    work = dial.open_channel(resolved, channel_options(work=True), interceptors)  # TLS and the gRPC key too
    probe = dial.open_channel(resolved, channel_options(work=False))
    work.get_state(try_to_connect=True)  # connect and learn the replicas' health before the first request
    try:
        yield Replicas(pb_grpc.ForgeStub(work), pb_grpc.ForgeStub(probe), work, config.ready_timeout_s)
    finally:
        await work.close()
        await probe.close()


def replicas_on(channel: grpc.aio.Channel, config: GatewayConfig) -> Replicas:
    """Replicas over a channel the caller made (tests): it serves as both work and probe channel."""
    stub = pb_grpc.ForgeStub(channel)
    return Replicas(stub, stub, channel, config.ready_timeout_s)
