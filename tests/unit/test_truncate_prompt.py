"""truncate_prompt_tokens (vLLM's): only the prompt's last N tokens are kept. The service on a fake
engine (one token per byte, context 128), and the field through the gateway."""
from __future__ import annotations

import grpc
import httpx
import pytest

from tests.unit.test_gateway import fake, http, stack  # noqa: F401 (fixtures)
from tests.unit.test_server_fake_engine import code_of, run, text_request

PROMPT = "".join(chr(ord("a") + i % 26) for i in range(200))  # 200 tokens: past the fake's context of 128


@pytest.mark.parametrize("truncate, kept", [(4, PROMPT[-4:]), (-1, PROMPT[-127:])])
def test_the_prompt_s_last_tokens_are_kept(truncate, kept):
    async def body(h):
        return await h.stub.Generate(text_request(PROMPT, max_tokens=1, truncate_prompt_tokens=truncate))

    response = run(body)
    assert response.usage.prompt_tokens == len(kept)
    assert response.choices[0].text == kept[0]  # the fake echoes its prompt: it begins where the cut is


@pytest.mark.parametrize("fields, words", [
    ({}, "context length is 128"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens must be -1 or from 1 to 127"),
    ({"truncate_prompt_tokens": 128}, "truncate_prompt_tokens must be -1 or from 1 to 127"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens must be -1 or from 1 to 127"),
])
def test_a_prompt_past_the_context_or_a_bad_cut_is_invalid(fields, words):
    async def body(h):
        return await code_of(h.stub.Generate(text_request(PROMPT, max_tokens=1, **fields)))

    code, details = run(body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details


def test_the_gateway_passes_the_cut_and_refuses_it_with_echo(http: httpx.Client, fake):
    body = {"model": "fake-model", "prompt": "abc", "truncate_prompt_tokens": 2}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert fake.requests[-1].truncate_prompt_tokens == 2
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "truncate_prompt_tokens": -1}
    assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert fake.requests[-1].truncate_prompt_tokens == -1
    assert http.post("/v1/completions", json={"model": "fake-model", "prompt": "abc"}).status_code == 200
    assert not fake.requests[-1].HasField("truncate_prompt_tokens")
    refused = http.post("/v1/completions", json={**body, "echo": True})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "truncate_prompt_tokens"
    low = http.post("/v1/completions", json={**body, "truncate_prompt_tokens": -2})
    assert low.status_code == 400 and low.json()["error"]["param"] == "truncate_prompt_tokens"
