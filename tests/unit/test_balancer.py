"""The gateway over several service replicas (fake engines, real gRPC servers on loopback):
round_robin spread, health-aware routing while a replica drains, retry of calls no replica
admitted, the bounded wait for a ready replica, and a replica restarted on the same port."""
from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc
import httpx
import pytest
import uvicorn

from forge_gateway import balancer
from forge_gateway.app import create_app
from forge_gateway.config import GatewayConfig
from forge_service.config import ServiceConfig
from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc
from forge_service.server import ForgeService, Phase
from forge_service.servicer import REPLICA_HEADER
from tests.ports import free_port
from tests.unit.fakes import FakeEngine, until

pytestmark = pytest.mark.timeout(90)


# ---- targets and the service config -------------------------------------------------------

def test_a_list_of_addresses_becomes_one_target_that_round_robin_spreads_over() -> None:
    assert balancer.channel_target("127.0.0.1:1,127.0.0.2:2") == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert balancer.channel_target(" 127.0.0.1:1 , localhost:2 ") == "ipv4:127.0.0.1:1,127.0.0.1:2"
    assert balancer.channel_target("[::1]:1,[::1]:2") == "ipv6:[::1]:1,[::1]:2"
    assert balancer.channel_target("127.0.0.1:50051") == "127.0.0.1:50051"
    assert balancer.channel_target("dns:///forge-service-headless:50051") == "dns:///forge-service-headless:50051"


@pytest.mark.parametrize("target, message", [
    ("", "empty"), ("127.0.0.1:1,[::1]:2", "mixes IPv4 and IPv6"), ("127.0.0.1:1,nohostport", "not HOST:PORT"),
    ("127.0.0.1:1,no-such-host.invalid:2", "cannot resolve"),
])
def test_bad_target_lists_are_refused_with_what_is_wrong(target: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        balancer.channel_target(target)


def test_service_config_balances_health_checks_and_retries_only_unavailable() -> None:
    options = dict(balancer.channel_options())
    config = json.loads(options["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": "forge.v1.Forge"}
    method = config["methodConfig"][0]
    assert method["name"] == [{"service": "forge.v1.Forge"}] and method["waitForReady"] is True
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert options["grpc.keepalive_time_ms"] > 0
    probe = json.loads(dict(balancer.channel_options(work=False))["grpc.service_config"])
    assert probe == {"loadBalancingConfig": [{"round_robin": {}}]}  # sees every replica, fails fast


# ---- replicas with fake engines behind one gateway ------------------------------------------

class Fleet:
    """Fake-engine replicas and a gateway in front of all of them, in one event loop."""

    def __init__(self) -> None:
        self.replicas: list[ForgeService] = []
        self.http: httpx.AsyncClient | None = None

    async def start_replica(self, port: int = 0, step_delay_s: float = 0.005) -> ForgeService:
        service = ForgeService(ServiceConfig(host="127.0.0.1", grpc_port=port), lambda: FakeEngine(step_delay_s=step_delay_s))
        await service.start()
        await service.load()
        self.replicas.append(service)
        return service

    def admitted(self) -> list[int]:
        return [r.health_response().requests_admitted for r in self.replicas]

    async def chat(self, content: str = "hello", **fields: Any) -> httpx.Response:
        assert self.http is not None
        body = {"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": 8, **fields}
        return await self.http.post("/v1/chat/completions", json=body)

    async def stream_events(self, content: str, max_tokens: int) -> list[Any]:
        assert self.http is not None
        body = {"model": "fake-model", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                "stream": True}
        async with self.http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            lines = [line async for line in response.aiter_lines() if line.startswith("data: ")]
        return [json.loads(line[6:]) for line in lines if line != "data: [DONE]"]


@contextlib.asynccontextmanager
async def fleet(n: int, ready_timeout_s: float = 2.0) -> AsyncIterator[Fleet]:
    f = Fleet()
    for _ in range(n):
        await f.start_replica()
    target = ",".join(f"127.0.0.1:{r.port}" for r in f.replicas)
    config = GatewayConfig(target=target, ready_timeout_s=ready_timeout_s)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=port, log_level="warning"))
    serving = asyncio.create_task(server.serve())
    await until(lambda: server.started, 10)
    f.http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30)
    try:
        await until_async(lambda: _status(f, "/health", 200), 10)
        yield f
    finally:
        await f.http.aclose()
        server.should_exit = True
        await serving
        for replica in f.replicas:
            await replica.stop()


async def _status(f: Fleet, path: str, status: int) -> bool:
    assert f.http is not None
    return (await f.http.get(path)).status_code == status


async def until_async(predicate: Callable[[], Awaitable[bool]], timeout: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_concurrent_requests_spread_over_both_replicas() -> None:
    async def main() -> list[int]:
        async with fleet(2) as f:
            answers = await asyncio.gather(*(f.chat(f"request {i}") for i in range(20)))
            assert [a.status_code for a in answers] == [200] * 20
            return f.admitted()

    a, b = asyncio.run(main())
    assert a + b == 20 and min(a, b) >= 8, (a, b)  # round_robin: about half each, not all on one


def test_a_draining_replica_finishes_its_stream_and_gets_no_new_work() -> None:
    async def main() -> None:
        async with fleet(2) as f:
            a, b = f.replicas
            streams = [asyncio.create_task(f.stream_events("x" * 60, 60)) for _ in range(2)]
            await until(lambda: a.in_flight == 1 and b.in_flight == 1, 10)
            before = f.admitted()
            draining = asyncio.create_task(a.drain(20))
            answers = await asyncio.gather(*(f.chat(f"late {i}") for i in range(10)))
            assert [r.status_code for r in answers] == [200] * 10
            assert f.admitted() == [before[0], before[1] + 10]  # none reached the draining replica
            for events in await asyncio.gather(*streams):
                finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
                assert finishes == ["length"] and not any("error" in e for e in events)
            assert await draining is True
            assert await _status(f, "/health", 200)  # one ready replica is enough

    asyncio.run(main())


def test_unavailable_before_admission_is_retried_on_another_replica() -> None:
    """A replica that refuses new work before its readiness says so (the window at the start of
    a drain): the gateway's retry policy sends those calls to the other replica."""
    async def main() -> None:
        async with fleet(2) as f:
            a, _ = f.replicas
            a.phase = Phase.DRAINING  # refuses with UNAVAILABLE, while grpc.health.v1 still says SERVING
            # One call at a time: round_robin alternates, so a refused attempt's retry goes to the other
            # replica. (Many calls at once can pick the refusing replica on every attempt; in a real
            # drain the window lasts until the health watch reports NOT_SERVING, milliseconds.)
            for i in range(6):
                assert (await f.chat(f"request {i}")).status_code == 200
                assert await f.stream_events(f"stream {i}", 4)
            assert f.admitted() == [0, 12]

    asyncio.run(main())


def test_no_ready_replica_is_503_after_the_bound_and_says_why() -> None:
    async def main() -> None:
        async with fleet(2, ready_timeout_s=0.5) as f:
            for replica in f.replicas:
                await replica.drain(0)
            started = asyncio.get_running_loop().time()
            refused = await f.chat()
            took = asyncio.get_running_loop().time() - started
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            error = refused.json()["error"]
            assert (error["type"], error["code"]) == ("service_unavailable", "unavailable")
            assert "no ready replica" in error["message"] and "draining" in error["message"]
            assert 0.4 < took < 5, took
            health = await f.http.get("/health")  # type: ignore[union-attr]
            assert health.status_code == 503 and health.json()["status"] == "draining"
            assert (await f.http.get("/livez")).status_code == 200  # type: ignore[union-attr]

    asyncio.run(main())


def test_a_replica_restarted_on_the_same_port_is_used_again() -> None:
    async def main() -> None:
        async with fleet(2) as f:
            a, b = f.replicas
            port = a.port
            await a.stop()
            f.replicas.remove(a)
            answers = await asyncio.gather(*(f.chat(f"while down {i}") for i in range(8)))
            assert [r.status_code for r in answers] == [200] * 8
            assert b.health_response().requests_admitted == 8
            again = await f.start_replica(port=port)
            assert again.port == port

            async def used() -> bool:
                assert (await f.chat()).status_code == 200
                return again.health_response().requests_admitted > 0

            await until_async(used, 15)

    asyncio.run(main())


# ---- what a replica tells the balancer ---------------------------------------------------

def test_admission_sends_the_replica_header_before_any_token_and_counts_in_health() -> None:
    async def main() -> None:
        fake = FakeEngine()
        fake.gate = threading.Event()  # steps wait: no token can come out
        service = ForgeService(ServiceConfig(host="127.0.0.1", grpc_port=0), lambda: fake)
        await service.start()
        await service.load()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{service.port}") as channel:
                stub = pb_grpc.ForgeStub(channel)
                call = stub.Stream(pb.GenerateRequest(text="hello", sampling=pb.SamplingParameters(), stopping=pb.StoppingParameters(max_tokens=2)))
                headers = await asyncio.wait_for(call.initial_metadata(), 5)
                health = await stub.Health(pb.HealthRequest())
                assert dict(headers)[REPLICA_HEADER] == health.replica == f"{socket.gethostname()}:{service.port}"
                assert (health.requests_admitted, health.requests_in_flight) == (1, 1)
                fake.gate.set()
                assert [m async for m in call]
                health = await stub.Health(pb.HealthRequest())
                assert (health.requests_admitted, health.requests_in_flight) == (1, 0)
        finally:
            fake.gate.set()
            await service.stop()

    asyncio.run(main())


def test_probes_need_no_api_key() -> None:
    async def main() -> tuple[int, int, int]:
        async with grpc.aio.insecure_channel("127.0.0.1:1") as channel:
            app = create_app(GatewayConfig(api_key="sekret", ready_timeout_s=0.1), channel=channel)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
                live, ready = (await c.get("/livez")).status_code, (await c.get("/health")).status_code
                return live, ready, (await c.get("/v1/models")).status_code

    assert asyncio.run(main()) == (200, 503, 401)  # alive; not ready (no replica); the API still needs the key


def test_calls_on_the_work_channel_pass_the_given_interceptors() -> None:
    class Count(grpc.aio.UnaryUnaryClientInterceptor):
        def __init__(self) -> None:
            self.methods: list[str] = []

        async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            method = details.method
            self.methods.append(method.decode() if isinstance(method, bytes) else method)
            return await continuation(details, request)

    async def main() -> list[str]:
        service = ForgeService(ServiceConfig(host="127.0.0.1", grpc_port=0), lambda: FakeEngine())
        await service.start()
        await service.load()
        count = Count()
        try:
            config = GatewayConfig(target=f"127.0.0.1:{service.port},127.0.0.1:{service.port}")
            async with balancer.open_replicas(config, [count]) as replicas:
                await replicas.work.Health(pb.HealthRequest(), timeout=5)
                await replicas.probe.Health(pb.HealthRequest(), timeout=5)
        finally:
            await service.stop()
        return count.methods

    assert asyncio.run(main()) == ["/forge.v1.Forge/Health"]  # the work channel's call only
