"""Scale-out with real processes on loopback: two `python -m forge_service` replicas and one
`python -m forge_gateway --target A,B`. Spread is proven by each replica's Health counters.

The tests run in file order on one fleet: spread, SIGTERM (drain) of replica A and its restart
on the same port, SIGKILL of replica B under load and its restart.
"""
from __future__ import annotations

import contextlib
import json
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Iterator

import httpx
import pytest

from forge_service.pb import forge_pb2 as pb
from tests.integration.serving.servers import SERVER_THREADS, ForgeProcess, free_port, running_forge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Small engines: two of them and the test share two cores.
SERVICE_ARGS = ["--kv-cache-bytes", str(64 << 20), "--max-num-seqs", "8", "--drain-timeout-s", "120",
                "--log-level", "warning", *SERVER_THREADS]
MODEL = "SmolLM2-135M-Instruct.Q4_1"


def service_command(port: int | None = None) -> list[str]:
    return [sys.executable, "-m", "forge_service", "--grpc-port", str(port) if port else "{grpc_port}",
            "--metrics-port", "{metrics_port}", *SERVICE_ARGS]


@contextlib.contextmanager
def replica(port: int | None = None) -> Iterator[ForgeProcess]:
    with running_forge([], command=service_command(port), grpc_port=port) as server:
        yield server


@dataclass
class Fleet:
    replicas: list[ForgeProcess]
    gateway: ForgeProcess
    stack: contextlib.ExitStack

    @property
    def url(self) -> str:
        return self.gateway.url

    def admitted(self) -> list[int]:
        return [r.health().requests_admitted for r in self.replicas]

    def restart(self, index: int) -> ForgeProcess:
        """A new replica process on the old one's port (the old one has exited)."""
        old = self.replicas[index]
        assert old.proc.poll() is not None
        new = self.stack.enter_context(replica(old.grpc_port))
        new.wait_ready()
        self.replicas[index] = new
        return new


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        replicas = [stack.enter_context(replica()) for _ in range(2)]
        target = ",".join(r.target for r in replicas)
        command = [sys.executable, "-m", "forge_gateway", "--target", target, "--port", "{http_port}",
                   "--log-level", "warning"]
        gateway = stack.enter_context(running_forge([], command=command, grpc_port=free_port()))
        for r in replicas:
            r.wait_ready()
        gateway.wait_until(lambda: gateway_status(gateway.url, "/health") == 200, 30, "the gateway ready")
        yield Fleet(replicas, gateway, stack)


def gateway_status(url: str, path: str) -> int | None:
    try:
        return httpx.get(url + path, timeout=5).status_code
    except httpx.TransportError:
        return None


def body(content: str, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, **extra}


def chat(url: str, content: str = "Name a color.", max_tokens: int = 4) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", json=body(content, max_tokens), timeout=240)


def stream(url: str, content: str, max_tokens: int, started: list[str] | None = None) -> list[Any]:
    """The stream's SSE payloads (JSON, then "[DONE]"); appends to `started` at its first event."""
    events: list[Any] = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=240,
                      json=body(content, max_tokens, stream=True, ignore_eos=True)) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None and len(events) == 2:
                    started.append(content)
    return events


def finish_reasons(events: list[Any]) -> list[str]:
    return [c["finish_reason"] for e in events if isinstance(e, dict) for c in e.get("choices", [])
            if c.get("finish_reason")]


def errors(events: list[Any]) -> list[dict[str, Any]]:
    return [e["error"] for e in events if isinstance(e, dict) and "error" in e]


def test_concurrent_requests_spread_over_both_replicas(fleet: Fleet) -> None:
    before = fleet.admitted()
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: chat(fleet.url, f"Count to {i}."), range(8)))
    assert [a.status_code for a in answers] == [200] * 8, [a.text for a in answers]
    added = [after - b for after, b in zip(fleet.admitted(), before)]
    assert sum(added) == 8 and min(added) >= 3, added  # round_robin: about half each


def test_sigterm_drains_a_replica_whose_streams_finish_while_new_work_goes_to_the_other(fleet: Fleet) -> None:
    a, b = fleet.replicas
    started: list[str] = []
    with ThreadPoolExecutor(8) as pool:
        # Long enough that A is still draining after the late requests, so that its counter can be read
        # (160 tokens once raced a fast machine: A drained and exited before the late requests returned).
        streams = [pool.submit(stream, fleet.url, f"Tell a story {i}.", 640, started) for i in range(4)]
        fleet.gateway.wait_until(lambda: len(started) == 4 and a.health().requests_in_flight >= 1, 60,
                                 "all streams flowing, one of them on replica A")
        a.proc.send_signal(signal.SIGTERM)
        a.wait_until(lambda: a.health().state == pb.SERVING_STATE_DRAINING, 10, "A draining")
        admitted_a, admitted_b = a.health().requests_admitted, b.health().requests_admitted
        late = list(pool.map(lambda i: chat(fleet.url, f"Late {i}."), range(4)))
        assert b.health().requests_admitted == admitted_b + 4  # the late requests all went to B ...
        assert a.health().requests_admitted == admitted_a  # ... and nothing new reached the draining A
        results = [s.result() for s in streams]
    assert [r.status_code for r in late] == [200] * 4, [r.text for r in late]
    for events in results:
        assert errors(events) == [] and finish_reasons(events) == ["length"] and events[-1] == "[DONE]"
    assert a.proc.wait(60) == 0, a.log_tail()
    assert gateway_status(fleet.url, "/health") == 200


def test_a_replica_restarted_on_the_same_port_is_used_again(fleet: Fleet) -> None:
    a = fleet.restart(0)

    def reached() -> bool:
        assert chat(fleet.url).status_code == 200
        return a.health().requests_admitted > 0

    fleet.gateway.wait_until(reached, 30, "a request on the restarted replica")


def test_sigkill_under_load_fails_only_its_requests_cleanly_and_the_survivor_serves_the_rest(fleet: Fleet) -> None:
    a, b = fleet.replicas
    started: list[str] = []
    with ThreadPoolExecutor(12) as pool:
        streams = [pool.submit(stream, fleet.url, f"Describe a city {i}.", 200, started) for i in range(4)]
        unary = [pool.submit(chat, fleet.url, f"Describe a river {i}.", 200) for i in range(2)]
        fleet.gateway.wait_until(lambda: len(started) == 4 and b.health().requests_in_flight >= 2, 120,
                                 "streams flowing on both replicas")
        on_b = b.health().requests_in_flight
        b.proc.send_signal(signal.SIGKILL)
        later = [pool.submit(chat, fleet.url, f"After {i}.") for i in range(6)]
        stream_results = [s.result() for s in streams]
        unary_results = [u.result() for u in unary]
        later_results = [f.result() for f in later]
    failed_streams = [errors(e) for e in stream_results if errors(e)]
    failed_unary = [u for u in unary_results if u.status_code != 200]
    assert len(failed_streams) + len(failed_unary) == on_b, (on_b, failed_streams, [u.text for u in failed_unary])
    for error_events in failed_streams:
        assert len(error_events) == 1 and error_events[0]["type"] == "service_unavailable"
    for events in stream_results:  # a stream ends with [DONE], or with the error event that ends it
        assert events[-1] == "[DONE]" if not errors(events) else "error" in events[-1]
        assert errors(events) or finish_reasons(events) == ["length"]
    for response in failed_unary:
        assert response.status_code == 503 and response.json()["error"]["code"] == "unavailable"
    assert [r.status_code for r in later_results] == [200] * 6, [r.text for r in later_results]
    assert gateway_status(fleet.url, "/health") == 200 and gateway_status(fleet.url, "/livez") == 200
    b.proc.wait(10)

    restarted = fleet.restart(1)
    fleet.gateway.wait_until(lambda: chat(fleet.url).status_code == 200 and restarted.health().requests_admitted > 0,
                             30, "a request on the replica restarted after SIGKILL")
