"""Greedy determinism in the default configuration (bf16, prefix caching, speculative decoding),
through the gateway: the same temperature-0 request gets the same tokens on a fresh server, after
a prefix-cache hit, inside a batch of 32 different requests, and with its prompt prefilled in
different chunks. It holds because every GEMM row runs the same native kernel whatever the batch
size, and attention, norms and sampling work row by row (see native/cpu/quant_gemm.c)."""
from __future__ import annotations

import contextlib
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import openai
import pytest

from forge_service.config import CacheConfig
from tests.integration.serving.servers import SERVER_THREADS, ForgeProcess, running_forge

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MAX_TOKENS = 16
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FACTS = ["The river runs north past the old mill.", "Bread rises faster in a warm kitchen.",
         "The library opens at nine on weekdays.", "Our team won the match by two goals.",
         "Snow closed the mountain pass in March.", "The train to the coast leaves at noon.",
         "She painted the fence a pale shade of green.", "Tomatoes grow well against a sunny wall."]
# About 1,100 prompt tokens: prefilled in three chunks of the default 512-token step budget.
LONG_TEXT = " ".join(f"Note {i}: {FACTS[i % len(FACTS)]}" for i in range(90))
LONG = [{"role": "user", "content": "Here are my notes. " + LONG_TEXT + " Which note mentions snow?"}]
# Its first half as a prompt of its own: sent first, it leaves the long prompt's leading blocks in
# the prefix cache, so the long prompt's prefill then starts at a different token.
HALF = [{"role": "user", "content": "Here are my notes. " + LONG_TEXT[:len(LONG_TEXT) // 2]}]
OTHERS = [[{"role": "user", "content": f"Write one sentence about {topic}."}]
          for topic in ("cats", "rivers", "the moon", "bread", "winter", "music", "trains", "gardens", "clocks",
                        "bees", "ships", "maps", "salt", "glass", "owls", "tea", "chess", "rain", "paper",
                        "copper", "deserts", "kites", "lamps", "wolves", "cheese", "bridges", "tides",
                        "violins", "islands", "ink")]


def _client(server: ForgeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def _ask(client: openai.OpenAI, messages: list[dict]) -> tuple[list[str], int]:
    """The greedy answer's tokens (as logprob entries: each token's text) and the prompt's cached tokens."""
    response = client.chat.completions.create(model=client.models.list().data[0].id, messages=messages, max_tokens=MAX_TOKENS,
                                              temperature=0, logprobs=True)
    tokens = [entry.token for entry in response.choices[0].logprobs.content]
    return tokens, response.usage.prompt_tokens_details.cached_tokens


def _together(client: openai.OpenAI, conversations: list[list[dict]]) -> list[list[str]]:
    with ThreadPoolExecutor(len(conversations)) as pool:
        return [tokens for tokens, _ in pool.map(lambda m: _ask(client, m), conversations)]


@pytest.fixture(scope="module")
def fresh_server() -> Callable[[], ForgeProcess]:
    """Starts `forge serve` in its default configuration; each call a new one (a fresh history)."""
    with contextlib.ExitStack() as servers:
        def start() -> ForgeProcess:
            server = servers.enter_context(running_forge([*SERVER_THREADS, "--log-level", "warning"]))
            server.wait_ready()
            return server

        yield start


@pytest.fixture(scope="module")
def first(fresh_server) -> Iterator[tuple[ForgeProcess, dict[str, list[str]]]]:
    """A fresh server's first answers to the two prompts under test."""
    server = fresh_server()
    client = _client(server)
    answers = {}
    for name, messages in (("france", FRANCE), ("long", LONG)):
        answers[name], _ = _ask(client, messages)
        assert len(answers[name]) == MAX_TOKENS or name == "france"
    yield server, answers


def test_the_capital_of_france_is_paris(first) -> None:
    _, answers = first
    assert "Paris" in "".join(answers["france"])


def test_a_prefix_cache_hit_gives_the_same_tokens(first) -> None:
    server, answers = first
    client = _client(server)
    for name, messages in (("france", FRANCE), ("long", LONG)):
        for _ in range(2):
            tokens, cached = _ask(client, messages)
            assert cached > 0, name  # the second pass reuses the first one's KV and recomputes a tail
            assert tokens == answers[name], name


def test_a_batch_of_32_different_requests_gives_the_same_tokens(first) -> None:
    server, answers = first
    got = _together(_client(server), [FRANCE, *OTHERS[:15], LONG, *OTHERS[15:]])
    assert len(got) == 32
    assert got[0] == answers["france"] and got[16] == answers["long"]
    assert len({tuple(t) for t in got}) > 16  # the others really are different requests


def test_another_prefill_split_on_another_server_gives_the_same_tokens(first, fresh_server) -> None:
    _, answers = first
    client = _client(fresh_server())
    _, cached = _ask(client, HALF)  # leaves the long prompt's first half in the prefix cache
    tokens, cached = _ask(client, LONG)
    assert 500 < cached < 1000  # the prefill started partway, not where the first server's did
    assert tokens == answers["long"]
    # the short prompt prefilled beside the long ones, which share each step's token budget
    got = _together(client, [LONG + [{"role": "assistant", "content": "Note 4."},
                                     {"role": "user", "content": f"And note {i}?"}] for i in range(6)] + [FRANCE])
    assert got[-1] == answers["france"]


def test_a_new_question_reuses_the_chat_template_to_the_token(fresh_server, hf_tokenizer) -> None:
    """Two different questions share the chat template's tokens before the user's words (the
    system prompt and the user turn's header), a run that ends inside a KV block. On a fresh
    server the second question takes all of them from the prefix cache, not only the whole
    blocks among them."""
    first = [{"role": "user", "content": "Which planet is the largest?"}]
    second = [{"role": "user", "content": "Name a famous bridge."}]
    a, b = (list(hf_tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)
                 ["input_ids"]) for m in (first, second))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared % CacheConfig().block_size != 0  # whole blocks alone would leave some of it
    client = _client(fresh_server())
    assert _ask(client, first)[1] == 0
    assert _ask(client, second)[1] == shared
