"""run_all: the gRPC service and the gateway in one event loop, with a fake engine, end to end."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import httpx
import openai
import pytest

from forge_gateway.app import listen_http
from forge_service.config import ServiceConfig
from forge_service.serve import run_all_async
from forge_service.server import ForgeService, Phase
from tests.ports import free_port
from tests.unit.fakes import FakeEngine, wait_ready

pytestmark = pytest.mark.timeout(60)


def wait_draining(url: str) -> None:
    """Until the gateway's /health stops answering 200 (5 s at most)."""
    deadline = time.monotonic() + 5
    while httpx.get(url + "/health").status_code == 200:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_one_process_serves_openai_clients_and_drains_on_sigterm() -> None:
    fake = FakeEngine(step_delay_s=0.02)
    config = ServiceConfig(host="127.0.0.1", grpc_port=0, http_port=free_port(), drain_timeout_s=10)
    url = f"http://127.0.0.1:{config.http_port}"

    def use_it() -> dict[str, object]:
        wait_ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(model="fake-model", max_tokens=4,
                                              messages=[{"role": "user", "content": "hi"}])
        stream = client.completions.create(model="fake-model", prompt="s" * 40, stream=True, max_tokens=40)
        text = next(iter(stream)).choices[0].text
        os.kill(os.getpid(), signal.SIGTERM)  # a request is in flight: the drain waits for it
        wait_draining(url)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "late"}])
        text += "".join(c.choices[0].text for c in stream if c.choices)
        return {"chat": chat.choices[0].message.content, "refused": refused.value.status_code, "streamed": text}

    async def main() -> dict[str, object]:
        service = ForgeService(config, lambda: fake)
        running = asyncio.create_task(run_all_async(service, config))
        result = await asyncio.to_thread(use_it)
        await asyncio.wait_for(running, 20)
        assert service.phase is Phase.DRAINING
        return result

    result = asyncio.run(main())
    assert result == {"chat": "<use", "refused": 503, "streamed": "s" * 40}
    assert fake.aborted == []  # the in-flight stream finished during the drain


def test_connections_to_the_gateway_socket_have_nagle_off() -> None:
    # With Nagle on, the first SSE event after the response headers waited for the client's delayed
    # ACK: ~40 ms more time to first token (asyncio sets TCP_NODELAY only on sockets that say TCP).
    async def main() -> int:
        loop = asyncio.get_running_loop()
        seen: asyncio.Future[int] = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                seen.set_result(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        with listen_http("127.0.0.1", 0) as sock:
            server = await loop.create_server(Probe, sock=sock)
            _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
            nodelay = await asyncio.wait_for(seen, 5)
            writer.close()
            server.close()
        return nodelay

    assert asyncio.run(main()) != 0


def test_a_second_sigterm_cuts_the_drain_short() -> None:
    fake = FakeEngine(step_delay_s=0.05)  # a 120-token stream: 6 s, where the drain would wait 30
    config = ServiceConfig(host="127.0.0.1", grpc_port=0, http_port=free_port(), metrics_port=0, drain_timeout_s=30)
    url = f"http://127.0.0.1:{config.http_port}"

    def signal_twice() -> None:
        wait_ready(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        stream = client.completions.create(model="fake-model", prompt="s" * 120, stream=True, max_tokens=120)
        next(iter(stream))
        os.kill(os.getpid(), signal.SIGTERM)
        wait_draining(url)
        # Still the service's to handle (were it Python's default, this signal would kill pytest)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
        os.kill(os.getpid(), signal.SIGTERM)

    async def main() -> float:
        service = ForgeService(config, lambda: fake)
        running = asyncio.create_task(run_all_async(service, config))
        await asyncio.to_thread(signal_twice)
        signalled = time.monotonic()
        await asyncio.wait_for(running, 20)
        return time.monotonic() - signalled

    assert asyncio.run(main()) < 3
    assert len(fake.aborted) == 1  # the stream in flight was cancelled, not finished
