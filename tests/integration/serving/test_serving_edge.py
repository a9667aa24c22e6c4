"""`forge serve` on the real model with TLS and a key on its gRPC port: the key and TLS hold, the
gateway still answers (it dials over a private socket), huge prompts are refused at once while
probes stay prompt, and SIGTERM lets every stream in flight finish, refuses new work and exits 0.

The tests share one server and run in file order; the last one stops it."""
from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc
from tests.integration.serving.servers import SERVER_THREADS, ForgeProcess, running_forge
from tests.unit.test_grpc_auth import Pki, pki  # noqa: F401 (the certificates fixture)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

KEY = "sk-edge-test"
AUTH = (("authorization", f"Bearer {KEY}"),)
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[ForgeProcess]:  # noqa: F811
    args = ["--api-key", KEY, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
            "--drain-timeout-s", "60", *SERVER_THREADS]
    with running_forge(args) as server:
        server._channel = grpc.secure_channel(server.target, grpc.ssl_channel_credentials(pki.bytes("ca")))
        server.wait_ready()
        yield server


def stub(server: ForgeProcess) -> pb_grpc.ForgeStub:
    return pb_grpc.ForgeStub(server.channel)


def chat_request(content: str = "Name three fruits.", max_tokens: int = MAX_TOKENS) -> pb.GenerateRequest:
    return pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=content)]),
                              sampling=pb.SamplingParameters(temperature=0.0),
                              stopping=pb.StoppingParameters(max_tokens=max_tokens, ignore_eos=True))


def code_of(fn: Any, *args: Any, **kwargs: Any) -> grpc.StatusCode:
    try:
        result = fn(*args, **kwargs)
        if hasattr(result, "__iter__") and not isinstance(result, pb.GenerateResponse):
            list(result)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def test_the_key_and_tls_protect_grpc_and_the_gateway_still_answers(tls_server: ForgeProcess) -> None:
    with grpc.insecure_channel(tls_server.target) as plain:
        assert code_of(pb_grpc.ForgeStub(plain).Health, pb.HealthRequest(), timeout=3) == grpc.StatusCode.UNAVAILABLE
    assert code_of(stub(tls_server).Generate, chat_request(max_tokens=1)) == grpc.StatusCode.UNAUTHENTICATED
    assert tls_server.health().ready  # probes need no key
    answer = stub(tls_server).Generate(chat_request(max_tokens=4), metadata=AUTH, timeout=60)
    assert answer.usage.completion_tokens == 4
    body = {"model": answer.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    response = httpx.post(tls_server.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert response.status_code == 200, response.text


def test_huge_prompts_are_refused_at_once_while_probes_stay_prompt(tls_server: ForgeProcess) -> None:
    health = health_pb2_grpc.HealthStub(tls_server.channel)
    delays: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            started = time.monotonic()
            health.Check(health_pb2.HealthCheckRequest(service="forge.v1.Forge"), timeout=5)
            delays.append(time.monotonic() - started)
            time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        # 10 MB: over --max-message-chars. 1,000,000 characters: within it, but the length bound
        # (no token of this vocabulary is longer than 81 characters) already exceeds the 8k context.
        for content, words in (("a" * (10 << 20), "--max-message-chars"), ("word " * 200_000, "at least")):
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                stub(tls_server).Generate(chat_request(content), metadata=AUTH, timeout=30)
            took = time.monotonic() - started
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in info.value.details()
            assert took < 0.5, f"refused after {took:.2f} s"
    finally:
        done.set()
        prober.join()
    assert delays and max(delays) < 0.5, max(delays)


# Long enough that the server is still draining when the late requests arrive (a fast machine
# finishes short streams, drains and exits before them).
DRAIN_TOKENS = 320


def test_sigterm_lets_every_stream_finish_refuses_new_work_and_exits_0(tls_server: ForgeProcess) -> None:
    pool = ThreadPoolExecutor(4)

    def grpc_stream(i: int) -> tuple[int, list[int]]:
        call = stub(tls_server).Stream(chat_request(f"Count to {i + 3}.", DRAIN_TOKENS), metadata=AUTH, timeout=120)
        tokens, finals = 0, []
        for message in call:
            if message.HasField("chunk"):
                tokens += len(message.chunk.token_ids)
            else:
                finals.append(message.final.finish_reason)
        return tokens, finals

    def sse_stream() -> list[dict]:
        body = {"model": tls_server.health().model, "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": DRAIN_TOKENS, "ignore_eos": True, "stream": True}
        chunks = []
        with httpx.stream("POST", tls_server.url + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunks.append(json.loads(line.removeprefix("data: ")))
        return chunks

    streams = [pool.submit(grpc_stream, i) for i in range(3)]
    sse = pool.submit(sse_stream)
    tls_server.wait_until(lambda: tls_server.health().num_running == 4, 60, "four streams running")
    tls_server.proc.send_signal(signal.SIGTERM)
    tls_server.wait_until(lambda: tls_server.health().state == pb.SERVING_STATE_DRAINING, 10, "draining")
    late = code_of(stub(tls_server).Generate, chat_request(max_tokens=1), metadata=AUTH, timeout=10)
    late_http = httpx.post(tls_server.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                           json={"model": "m", "messages": [{"role": "user", "content": "x"}]}, timeout=10)
    results = [f.result(120) for f in streams]
    chunks = sse.result(120)
    pool.shutdown()
    assert late == grpc.StatusCode.UNAVAILABLE
    assert late_http.status_code == 503 and "draining" in late_http.json()["error"]["message"]
    assert results == [(DRAIN_TOKENS, [pb.FINISH_REASON_LENGTH])] * 3
    assert not any("error" in c for c in chunks)
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["length"]
    assert tls_server.proc.wait(60) == 0, tls_server.log_tail()
