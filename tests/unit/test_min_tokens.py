"""min_tokens (vLLM's sampling parameter): the first min_tokens tokens are generated whatever
comes. On the tiny model: stop tokens are not sampled among them (with drafts too), stop strings
are looked for only after them; the checks; and the field through the gateway and the service."""
from __future__ import annotations

import grpc
import httpx
import pytest

from forge_service import LLM, SamplingParams
from forge_service.errors import InvalidArgument
from forge_service.pb import forge_pb2 as pb
from forge_service.structured import Constraint
from tests.unit.test_engine_tiny import tiny_dir  # noqa: F401 (a fixture: the sharp tiny model)
from tests.unit.test_gateway import chat_body, fake, http, stack  # noqa: F401 (fixtures)
from tests.unit.test_server_fake_engine import code_of, run, text_request
from tests.unit.test_speculative_engine import FREE_ROWS, LOOPING

EOS = 2  # the tiny model's


@pytest.fixture(scope="module")
def engines(tiny_dir):  # noqa: F811
    return (LLM(model=str(tiny_dir), dtype="float32"),
            LLM(model=str(tiny_dir), dtype="float32", speculative="ngram", spec_step_base_rows=FREE_ROWS))


@pytest.mark.parametrize("stop", [{}, {"stop_token_ids": [9]}])
def test_no_stop_token_is_sampled_among_the_first_min_tokens(engines, stop):
    """A stop token that every step would pick (logit_bias) comes only after min_tokens tokens, the
    same with drafting on; without min_tokens it is the first token."""
    token = stop.get("stop_token_ids", [EOS])[0]
    forced = dict(temperature=0, max_tokens=30, logit_bias={token: 100.0}, **stop)
    for llm in engines:
        [alone] = llm.generate([LOOPING[0]], SamplingParams(**forced))
        assert alone.outputs[0].token_ids == [token] and alone.outputs[0].finish_reason == "stop"
        outs = llm.generate(LOOPING, SamplingParams(**forced, min_tokens=7))
        for out in outs:
            tokens = out.outputs[0].token_ids
            assert len(tokens) == 8 and token not in tokens[:7] and tokens[7] == token, tokens
            assert out.outputs[0].finish_reason == "stop"


def _twice(llm: LLM, ok=lambda token, before: True) -> tuple[list[int], list[int], int, int, int]:
    """(prompt, its greedy output, a token the output has twice, where it first and second is)."""
    for prompt in LOOPING:
        [base] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
        tokens = base.outputs[0].token_ids
        for first, token in enumerate(tokens):
            if token in tokens[first + 1:] and token not in tokens[:first] and ok(token, tokens[:first]):
                return prompt, tokens, token, first, tokens.index(token, first + 1)
    raise AssertionError("no greedy output has a token twice")


def test_drafted_runs_keep_min_tokens_and_change_nothing_else(engines):
    """Greedy, a stop token the output has twice, min_tokens past the first: where it came first,
    the next most likely token comes instead; the same tokens with drafts on (the prompts loop:
    drafts are accepted)."""
    off, on = engines
    prompt, tokens, token, first, _ = _twice(off)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop_token_ids=[token], min_tokens=first + 1)
    want, got = off.generate(LOOPING, params), on.generate(LOOPING, params)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    out = want[LOOPING.index(prompt)].outputs[0]
    assert out.token_ids[:first] == tokens[:first] and not {token, EOS} & set(out.token_ids[:first + 1])
    assert out.finish_reason == "length" or (out.token_ids[-1] in (token, EOS) and out.finish_reason == "stop")
    assert sum(g.outputs[0].num_accepted_tokens for g in got) > 0


def test_stop_strings_are_looked_for_after_the_first_min_tokens(engines):
    llm = engines[0]
    decode = llm.tokenizer.decode
    prompt, tokens, token, first, second = _twice(
        llm, lambda t, before: len(decode([t])) == 1 and decode([t]) not in decode(before))
    stop = decode([token])
    params = dict(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    [early] = llm.generate([prompt], SamplingParams(**params))
    assert early.outputs[0].token_ids == tokens[:first + 1] and early.outputs[0].stop_reason == stop
    [late] = llm.generate([prompt], SamplingParams(**params, min_tokens=first + 1))
    assert late.outputs[0].token_ids == tokens[:second + 1] and late.outputs[0].stop_reason == stop
    assert late.outputs[0].text == decode(tokens[:second])


@pytest.mark.parametrize("params, words", [
    (dict(min_tokens=5, max_tokens=4), "min_tokens (5) must be <= max_tokens (4)"),
    (dict(min_tokens=-1), "min_tokens must be >= 0"),
    (dict(min_tokens=2, constraint=Constraint("regex", "a+")), "cannot be combined with structured output"),
])
def test_min_tokens_out_of_bounds_is_invalid(params, words):
    with pytest.raises(InvalidArgument, match=words.replace("(", r"\(").replace(")", r"\)")) as error:
        SamplingParams(**params).validate()
    assert error.value.field == "min_tokens"


def test_the_gateway_passes_min_tokens_and_the_service_names_it(http: httpx.Client, fake):
    assert http.post("/v1/chat/completions", json=chat_body(min_tokens=3)).status_code == 200
    assert fake.requests[-1].stopping.min_tokens == 3
    assert http.post("/v1/completions", json={"model": "fake-model", "prompt": "a", "min_tokens": 2}).status_code == 200
    assert fake.requests[-1].stopping.min_tokens == 2
    refused = http.post("/v1/chat/completions", json=chat_body(min_tokens=-1))
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "min_tokens"

    async def body(h):
        request = text_request("abc", max_tokens=2)
        request.stopping.min_tokens = 3
        return await code_of(h.stub.Generate(request))

    code, details = run(body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens (3) must be <= max_tokens (2)" in details
    assert pb.StoppingParameters(min_tokens=4).min_tokens == 4
