"""Gateway limits against real processes on loopback ports: `forge serve` (service and its gateway,
default limits) and a separate `python -m forge_gateway --api-key ... --max-...` in front of the same
service. Each refusal is fast OpenAI error JSON, and the server stays healthy."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

import httpx
import openai
import pytest

from tests.integration.serving.servers import REPO, SERVER_THREADS, ForgeProcess, free_port, running_forge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
KEY = "limits-key"
JSON = {"content-type": "application/json"}
AUTH = {**JSON, "authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server() -> Iterator[ForgeProcess]:
    with running_forge([*SERVER_THREADS, "--log-level", "warning"]) as forge:
        forge.wait_ready()
        yield forge


@pytest.fixture(scope="module")
def locked_gateway(server: ForgeProcess) -> Iterator[str]:
    """`python -m forge_gateway` with a key and small limits, set by flags, in front of `server`."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("FORGE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-m", "forge_gateway", "--target", server.target, "--port", str(port),
            "--api-key", KEY, "--max-body-bytes", "65536", "--max-prompts", "2", "--log-level", "warning"]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _answers(url + "/health"):
            assert proc.poll() is None and time.monotonic() < deadline, "the gateway did not start"
            time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _answers(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2).status_code == 200
    return False


def declared_but_unsent(url: str, path: str, declared: int, sent: bytes) -> tuple[int, dict[str, Any], float]:
    """POST declaring `declared` body bytes but sending only `sent`; (status, JSON body, seconds)."""
    port = int(url.rsplit(":", 1)[1])
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {declared}\r\n\r\n"
        sock.sendall(head.encode() + sent)
        received = b""
        while not (b"\r\n\r\n" in received and received.rstrip().endswith(b"}")):
            data = sock.recv(65536)
            if not data:
                break
            received += data
    head_bytes, _, body = received.partition(b"\r\n\r\n")
    return int(head_bytes.split()[1]), json.loads(body), time.monotonic() - start


def chat(content: str = "Say hi.", **fields: Any) -> dict[str, Any]:
    """A chat body; the gateway's limits come before the model name is looked at."""
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 4, **fields}


@pytest.fixture(scope="module")
def served(server: ForgeProcess) -> str:
    return server.health().model


def test_a_70_mib_body_is_413_before_it_is_read(server: ForgeProcess, served: str) -> None:
    status, body, seconds = declared_but_unsent(server.url, "/v1/chat/completions", 70 << 20, b"x" * (1 << 20))
    assert status == 413 and body["error"]["code"] == "request_too_large", body
    assert seconds < 1.0
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200
    assert httpx.post(server.url + "/v1/chat/completions", json=chat(model=served), timeout=60).status_code == 200


def _body(fields: dict[str, Any], text: str = "Say hi.") -> Callable[[str], bytes]:
    """A chat (or completions, with `prompt`) body for the served model, as JSON bytes."""
    def build(model: str) -> bytes:
        base = {"prompt": "x"} if "prompt" in fields else {"messages": [{"role": "user", "content": text}]}
        return json.dumps({"model": model, **base, "max_tokens": 4, **fields}).replace("SURROGATE", "\\ud800").encode()

    return build


DEEP_SCHEMA = json.loads('{"items": ' * 80 + "{}" + "}" * 80)


@pytest.mark.parametrize("name, build, headers", [
    ("lone surrogate", _body({}, "Say SURROGATE"), JSON),
    ("timeout nan", _body({}), {**JSON, "X-Request-Timeout": "nan"}),
    ("timeout negative", _body({}), {**JSON, "X-Request-Timeout": "-5"}),
    ("deep schema", _body({"guided_json": DEEP_SCHEMA}), JSON),
    ("unknown fields", _body({"padding": "x" * (1 << 20)}), JSON),
    ("too many prompts", _body({"prompt": ["a"] * 65, "max_tokens": 1}), JSON),
    ("wrong type", _body({"max_tokens": "4"}), JSON),
    # Fits the context, so only the gateway's bound (2**18 tokens) refuses it; last, as without that
    # bound the service would work on it until the client gives up.
    ("n x max_tokens", _body({"n": 64, "max_tokens": 4097}), JSON),
])
def test_hostile_input_is_400_in_well_under_a_second(server: ForgeProcess, served: str, name: str,
                                                     build: Callable[[str], bytes], headers: dict[str, str]) -> None:
    raw = build(served)
    path = "/v1/completions" if b'"prompt"' in raw else "/v1/chat/completions"
    start = time.monotonic()
    response = httpx.post(server.url + path, content=raw, headers=headers, timeout=60)
    seconds = time.monotonic() - start
    assert response.status_code == 400, (name, response.text)
    assert response.json()["error"]["type"] == "invalid_request_error" and seconds < 1.0
    assert httpx.get(server.url + "/health", timeout=5).status_code == 200


def test_key_first_then_limits_from_flags(locked_gateway: str, served: str) -> None:
    url = locked_gateway + "/v1/chat/completions"
    malformed = httpx.post(url, content=b"{not json", headers=JSON)
    assert malformed.status_code == 401 and malformed.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(locked_gateway + "/openapi.json").status_code == 401
    assert httpx.post(url, content=b"{not json", headers=AUTH).status_code == 400
    too_big = httpx.post(url, json=chat("x" * 70_000), headers=AUTH)
    assert too_big.status_code == 413 and too_big.json()["error"]["code"] == "request_too_large"
    prompts = httpx.post(locked_gateway + "/v1/completions", headers=AUTH,
                         json={"model": "m", "prompt": ["a", "b", "c"], "max_tokens": 1})
    assert prompts.status_code == 400 and prompts.json()["error"]["param"] == "prompt"
    assert httpx.post(url, json=chat(model=served), headers=AUTH, timeout=60).status_code == 200


def test_openai_client_gets_413_for_a_body_over_the_bound(locked_gateway: str, served: str) -> None:
    client = openai.OpenAI(base_url=locked_gateway + "/v1", api_key=KEY, max_retries=2, timeout=60)
    with pytest.raises(openai.APIStatusError) as info:
        client.chat.completions.create(model=served, messages=[{"role": "user", "content": "x" * 70_000}])
    assert info.value.status_code == 413 and not isinstance(info.value, openai.RateLimitError)
    reply = client.chat.completions.create(model=served, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")
