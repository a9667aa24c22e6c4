"""Speculative decoding on the real model through the gateway, in the default configuration (bf16,
prefix caching on): for the integration prompts, greedy outputs are the same with and without
drafting (the client opts out with `num_speculative_tokens: 0`), usage reports the drafts, and so
do the metrics. The opt-out request runs second and hits the prefix cache: its answer matching
also rests on the bf16 path's batch invariance (test_serving_determinism.py).
"""
from __future__ import annotations

from typing import Iterator

import openai
import pytest

from tests.integration.conftest import CHAT_PROMPTS, RAW_PROMPTS
from tests.integration.serving.servers import SERVER_THREADS, ForgeProcess, running_forge
from tests.integration.serving.test_observability import scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MAX_TOKENS = 48
# A prompt whose answer copies from it, so that drafts are certain to be accepted.
COPY = [{"role": "user", "content": "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog, "
                                    "and the lazy dog sleeps in the warm afternoon sun."}]


@pytest.fixture(scope="module")
def spec_server() -> Iterator[ForgeProcess]:
    args = ["--speculative", "ngram", *SERVER_THREADS, "--log-level", "warning"]
    with running_forge(args) as server:
        server.wait_ready()
        yield server


def test_greedy_outputs_are_the_same_with_and_without_drafts(spec_server: ForgeProcess) -> None:
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    before = scrape(f"http://127.0.0.1:{spec_server.metrics_port}/metrics")
    drafted = accepted = 0
    for messages in [*CHAT_PROMPTS, COPY]:
        answers = {}
        for opt_out in (True, False):
            extra = {"num_speculative_tokens": 0} if opt_out else {}
            response = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                      temperature=0, extra_body=extra)
            answers[opt_out] = response.choices[0].message.content
            details = response.usage.completion_tokens_details
            if opt_out:
                assert details.accepted_prediction_tokens == details.rejected_prediction_tokens == 0
            else:
                drafted += details.accepted_prediction_tokens + details.rejected_prediction_tokens
                accepted += details.accepted_prediction_tokens
        assert answers[False] == answers[True], messages
    for prompt in RAW_PROMPTS:
        texts = [client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                           extra_body=extra).choices[0].text
                 for extra in ({"num_speculative_tokens": 0}, {})]
        assert texts[0] == texts[1], prompt
    assert 0 < accepted < drafted  # drafts were verified both ways
    after = scrape(f"http://127.0.0.1:{spec_server.metrics_port}/metrics")

    def grew(name: str) -> float:
        key = next(k for k in after if k[0] == name)
        return after[key] - before.get(key, 0.0)

    assert grew("forge_spec_decode_draft_tokens_total") >= drafted
    assert grew("forge_spec_decode_accepted_tokens_total") >= accepted


def test_a_predicted_output_speeds_an_edit_and_changes_no_answer(spec_server: ForgeProcess) -> None:
    """OpenAI's `prediction`: the client sends the text it expects back (here the answer without a
    prediction, with a word edited, as a file being edited would differ); drafts come from it, and
    the answer is the same."""
    client = openai.OpenAI(base_url=spec_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    for messages in (CHAT_PROMPTS[1], CHAT_PROMPTS[7]):  # answers of 48 tokens that copy little from the prompt
        plain = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        answer = plain.choices[0].message.content
        edited = answer.replace(" the ", " a ", 1)
        assert edited != answer
        for prediction in (answer, edited):
            response = client.chat.completions.create(model=model, messages=messages, max_tokens=MAX_TOKENS,
                                                      temperature=0,
                                                      prediction={"type": "content", "content": prediction})
            assert response.choices[0].message.content == answer, prediction
            accepted = response.usage.completion_tokens_details.accepted_prediction_tokens
            # Drafted from the prediction, more is accepted than from the prompt and output alone.
            assert accepted > plain.usage.completion_tokens_details.accepted_prediction_tokens, prediction
            assert accepted >= response.usage.completion_tokens // 2, prediction
