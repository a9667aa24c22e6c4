"""A server's life on the real model: loading (503), auth (401), a full queue (429), draining
on SIGTERM (503 to new work, in-flight requests finish, exit 0), and the README's `make serve`.

These need their own short-lived servers, so they do not use the session server. The tests
of the small server run in file order: it is loading during the first one and gone after the last.
"""
from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2

from forge_service.pb import forge_pb2 as pb
from tests.integration.serving.servers import REPO, SERVER_THREADS, VENV, ForgeProcess, running_forge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

API_KEY = "sk-forge-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "Name three fruits."}]


@pytest.fixture(scope="module")
def small_server() -> Iterator[ForgeProcess]:
    """One running and one waiting request at most, an API key, and a drain long enough to finish
    a stream. Not waited on: the first test watches it load."""
    args = ["--max-num-seqs", "1", "--max-waiting", "1", "--api-key", API_KEY, "--drain-timeout-s", "60",
            *SERVER_THREADS]
    with running_forge(args) as server:
        yield server


def chat_body(**extra: Any) -> dict[str, Any]:
    return {"model": "SmolLM2-135M-Instruct.Q4_1", "messages": CHAT, **extra}


def post_chat(server: ForgeProcess, headers: dict[str, str] | None = AUTH, **extra: Any) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json=chat_body(**extra), headers=headers, timeout=120)


def gateway_health(server: ForgeProcess) -> httpx.Response | None:
    try:
        return httpx.get(server.url + "/health", timeout=5)
    except httpx.TransportError:
        return None


def assert_error(response: httpx.Response, status: int, type_: str, code: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == (type_, code), error


def data_lines(lines: Iterator[str]) -> Iterator[str]:
    return (line.removeprefix("data: ") for line in lines if line.startswith("data: "))


def test_requests_while_the_model_loads_get_503(small_server: ForgeProcess) -> None:
    small_server.wait_until(lambda: gateway_health(small_server) is not None, 60, "the gateway listening")
    assert small_server.health().state == pb.SERVING_STATE_LOADING
    refused = post_chat(small_server, max_tokens=1)
    liveness, readiness = small_server.readiness(""), small_server.readiness()
    health = gateway_health(small_server)
    # Still loading after the answers, so it was loading while they were given.
    assert small_server.health().state == pb.SERVING_STATE_LOADING, "the model loaded too fast to see it load"
    assert_error(refused, 503, "service_unavailable", "unavailable")
    assert refused.headers["retry-after"] == "1"
    assert "loading" in refused.json()["error"]["message"]
    assert (health.status_code, health.json()["status"]) == (503, "loading")
    assert liveness == health_pb2.HealthCheckResponse.SERVING
    assert readiness == health_pb2.HealthCheckResponse.NOT_SERVING


def test_api_key_is_required(small_server: ForgeProcess) -> None:
    small_server.wait_ready()
    assert_error(post_chat(small_server, headers=None, max_tokens=1), 401, "invalid_request_error", "invalid_api_key")
    wrong = {"Authorization": "Bearer sk-wrong"}
    assert_error(post_chat(small_server, headers=wrong, max_tokens=1), 401, "invalid_request_error", "invalid_api_key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=small_server.url + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=small_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    answer = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", messages=CHAT, max_tokens=2)
    assert answer.choices[0].message.content
    assert gateway_health(small_server).status_code == 200  # probes need no key


def test_a_full_queue_answers_429_with_retry_after(small_server: ForgeProcess) -> None:
    small_server.wait_ready()
    endless = chat_body(max_tokens=4000, ignore_eos=True, stream=True)
    pool = ThreadPoolExecutor(3)
    try:
        with httpx.stream("POST", small_server.url + "/v1/chat/completions", json=endless, headers=AUTH,
                          timeout=120) as running:
            # Hold the line iterator: dropping it would close the connection and cancel the stream.
            lines = data_lines(running.iter_lines())
            next(lines)
            assert small_server.health().num_running == 1  # the one seat is taken
            arrivals = [pool.submit(post_chat, small_server, max_tokens=2) for _ in range(3)]
            small_server.wait_until(lambda: sum(f.done() for f in arrivals) >= 2, 30, "two answers")
            rejected = [f.result() for f in arrivals if f.done()]
            assert len(rejected) == 2
            small_server.wait_until(lambda: small_server.health().num_waiting == 1, 10, "the third one waiting")
            assert sum(f.done() for f in arrivals) == 2  # the third waits for the seat
        # Leaving the endless stream frees the seat for the waiting request.
    finally:
        pool.shutdown(wait=True)
    admitted = [f.result() for f in arrivals if f.result().status_code != 429]
    for response in rejected:
        assert_error(response, 429, "rate_limit_error", "queue_full")
        assert response.headers["retry-after"] == "1"
        assert "waiting queue is full" in response.json()["error"]["message"]
    assert [r.status_code for r in admitted] == [200]
    small_server.wait_idle()


DRAIN_TOKENS = 240


def test_sigterm_drains_the_requests_in_flight_and_exits_0(small_server: ForgeProcess) -> None:
    small_server.wait_ready()
    # Long enough that the server is still draining when the checks below run (a fast machine
    # finishes a short stream, drains and exits before them).
    body = chat_body(max_tokens=DRAIN_TOKENS, ignore_eos=True, temperature=0, stream=True,
                     stream_options={"include_usage": True})
    with httpx.stream("POST", small_server.url + "/v1/chat/completions", json=body, headers=AUTH,
                      timeout=120) as stream, ThreadPoolExecutor(1) as pool:
        events = data_lines(stream.iter_lines())
        received = [next(events)]
        # A non-streaming request admitted before the signal (waiting behind the stream) finishes
        # too: the gateway must not take its replica's readiness turning off for a failure.
        unary = pool.submit(post_chat, small_server, max_tokens=8, ignore_eos=True)
        small_server.wait_until(lambda: small_server.health().requests_in_flight == 2, 30, "two in flight")
        small_server.proc.send_signal(signal.SIGTERM)
        small_server.wait_until(lambda: gateway_health(small_server).status_code == 503, 10, "draining")
        assert gateway_health(small_server).json()["status"] == "draining"
        assert small_server.health().state == pb.SERVING_STATE_DRAINING
        assert small_server.readiness() == health_pb2.HealthCheckResponse.NOT_SERVING
        late = post_chat(small_server, max_tokens=1)
        assert_error(late, 503, "service_unavailable", "unavailable")
        assert late.headers["retry-after"] == "1" and "draining" in late.json()["error"]["message"]
        received += list(events)
        answered = unary.result(timeout=120)
    assert received[-1] == "[DONE]"
    chunks = [json.loads(e) for e in received[:-1]]
    assert not any("error" in c for c in chunks), chunks[-3:]
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]]
    assert finishes == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == DRAIN_TOKENS
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["completion_tokens"] == 8
    assert small_server.proc.wait(60) == 0, small_server.log_tail()


# ---- the README's set-up, as a new user runs it ----------------------------------------

def readme_promise() -> tuple[str, float]:
    """The README's curl command and the seconds it says `make serve` takes to answer it."""
    readme = (REPO / "README.md").read_text()
    seconds = re.search(r"about (\d+) s after the install", readme)
    curl = re.search(r"```sh\n(curl .*?)\n```", readme, re.S)
    assert seconds and curl, "the README no longer states the serve time or the curl command"
    return curl.group(1), float(seconds.group(1))


def fresh_checkout(dest: Path) -> str:
    """A clone of the repository; while the working tree has uncommitted work, a copy of the
    files a clone would have once it is committed (tracked and untracked, not ignored)."""
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, check=True)
    if not dirty.stdout.strip():
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(dest)], check=True)
        return "git clone"
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                            text=True, check=True).stdout.split("\0")
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return "copy of the working tree"


def test_make_serve_on_a_fresh_checkout_answers_the_readme_curl_in_time(tmp_path: Path) -> None:
    curl, promised_s = readme_promise()
    checkout = tmp_path / "forge"
    how = fresh_checkout(checkout)
    # The venv is reused (installing torch is not what this measures): `-o` tells make that its
    # install stamp is up to date, and PYTHONPATH makes the checkout's code the code that runs.
    stamp = VENV / ".forge-installed"
    command = ["make", "-o", str(stamp), "serve", f"VENV={VENV}",
               "ARGS=--grpc-port {grpc_port} --http-port {http_port} --metrics-port {metrics_port}"]
    with running_forge([], command=command, cwd=checkout, env={"PYTHONPATH": str(checkout)}) as server:
        ask = curl.replace("localhost:8000", f"127.0.0.1:{server.http_port}") + " -w '\\n%{http_code}'"
        answer: dict[str, Any] = {}
        listening_s = None  # when the gateway first answered at all (503 while the model loads)
        while not answer:
            server.check_alive()
            assert time.monotonic() - server.started_at < 120, server.log_tail()
            out = subprocess.run(["bash", "-c", ask], capture_output=True, text=True, timeout=60).stdout
            body, _, status = out.rpartition("\n")
            if status != "000" and listening_s is None:
                listening_s = time.monotonic() - server.started_at
            if status == "200":
                answer = json.loads(body)
            else:
                time.sleep(0.25)
        took = time.monotonic() - server.started_at
        loaded = re.search(r"ready in ([\d.]+ s)", server.log_tail(100_000))
        report = (f"make serve ({how}): the gateway answered after {listening_s:.1f} s, the model was ready "
                  f"{loaded.group(1) if loaded else '?'} after the gRPC server started, the README's curl got its "
                  f"completion after {took:.1f} s; the README says about {promised_s:.0f} s")
        print(report)
        assert answer["choices"][0]["message"]["content"]
        assert took <= promised_s, report
