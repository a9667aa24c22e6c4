"""Fixtures for the serving acceptance tests: one real `forge serve` for the whole package."""
from __future__ import annotations

from typing import Iterator

import openai
import pytest

from forge_service.pb import forge_pb2_grpc as pb_grpc
from tests.integration.serving.servers import SERVER_THREADS, ForgeProcess, running_forge


@pytest.fixture(scope="package")
def forge_server(request: pytest.FixtureRequest) -> Iterator[ForgeProcess]:
    """`forge serve --dtype float32` on free loopback ports, ready (grpc.health.v1 SERVING).

    float32 so that its greedy outputs and logprobs can be compared with `llm_fp32`."""
    with running_forge(["--dtype", "float32", *SERVER_THREADS, "--log-level", "warning"]) as server:
        request.getfixturevalue("llm_fp32")  # loads in this process while the server loads in its own
        server.wait_ready()
        yield server


@pytest.fixture(scope="package")
def model_name(forge_server: ForgeProcess) -> str:
    return forge_server.health().model


@pytest.fixture(scope="package")
def forge_stub(forge_server: ForgeProcess) -> pb_grpc.ForgeStub:
    return forge_server.stub


@pytest.fixture(scope="package")
def openai_client(forge_server: ForgeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=forge_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def idle_server(forge_server: ForgeProcess) -> Iterator[ForgeProcess]:
    """The session server, checked to hold no request and no KV block before and after the test."""
    forge_server.wait_idle()
    yield forge_server
    forge_server.wait_idle()
