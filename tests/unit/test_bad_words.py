"""bad_words (vLLM's sampling parameter): the output never contains them. The ban rule, the words'
token sequences, the tiny model's output with and without drafts, the checks, and the field
through the gateway and the service."""
from __future__ import annotations

import grpc
import httpx
import pytest

from forge_service import SamplingParams
from forge_service.errors import InvalidArgument
from forge_service.sampling.bad_words import bad_word_ids, banned_tokens
from forge_service.structured import Constraint
from tests.unit.test_engine_tiny import tiny_dir  # noqa: F401 (a fixture: the sharp tiny model)
from tests.unit.test_gateway import chat_body, fake, http, stack  # noqa: F401 (fixtures)
from tests.unit.test_min_tokens import engines  # noqa: F401 (a fixture: the tiny model without and with drafts)
from tests.unit.test_server_fake_engine import code_of, run, text_request
from tests.unit.test_speculative_engine import LOOPING


@pytest.mark.parametrize("output, banned", [
    ([], {5}), ([1, 7, 8], {5, 9}), ([7, 8, 1], {5}), ([8], {5}), ([7, 8, 7, 8], {5, 9})])
def test_a_word_s_last_token_is_banned_where_the_output_ends_with_the_rest(output, banned):
    assert banned_tokens(((5,), (7, 8, 9)), output) == banned


def test_a_word_is_taken_as_written_and_after_a_space(engines):  # noqa: F811
    tokenizer = engines[0].tokenizer
    sequences = bad_word_ids(tokenizer, ["ab", " ab", "ab"])
    assert sequences == (tuple(tokenizer.encode("ab", add_special_tokens=False)),
                         tuple(tokenizer.encode(" ab", add_special_tokens=False)))


def _clean_pair(llm, outputs: list[list[int]]) -> tuple[int, int]:
    """(which output, where) two tokens in a row read as two characters that encode back to them."""
    for k, tokens in enumerate(outputs):
        for i in range(len(tokens) - 1):
            text = llm.tokenizer.decode(tokens[i:i + 2])
            if len(text) == 2 and text.isprintable() and \
                    llm.tokenizer.encode(text, add_special_tokens=False) == tokens[i:i + 2]:
                return k, i
    raise AssertionError("no two output tokens read as two clean characters")


def test_the_output_never_contains_a_bad_word(engines):  # noqa: F811
    """A two-token word from a greedy output: the output is the same up to where the word would
    be completed, then goes another way, never writing it; the same with drafts on."""
    off, on = engines
    params = dict(temperature=0, max_tokens=30, ignore_eos=True)
    base = [b.outputs[0].token_ids for b in off.generate(LOOPING, SamplingParams(**params))]
    k, at = _clean_pair(off, base)
    word = off.tokenizer.decode(base[k][at:at + 2])
    banned = SamplingParams(**params, bad_words=[word])
    want, got = off.generate(LOOPING, banned), on.generate(LOOPING, banned)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    out = want[k].outputs[0].token_ids
    assert out[:at + 1] == base[k][:at + 1] and out[at + 1] != base[k][at + 1]
    for w in want:
        assert word not in w.outputs[0].text
    assert sum(g.outputs[0].num_accepted_tokens for g in got) > 0


@pytest.mark.parametrize("params, words", [
    (dict(bad_words=["w"] * 65), "at most 64 bad_words"),
    (dict(bad_words=[" "]), "non-blank"),
    (dict(bad_words=["x" * 257]), "at most 256 characters"),
    (dict(bad_words=["a"], constraint=Constraint("regex", "a+")), "cannot be combined with structured output"),
])
def test_bad_words_out_of_bounds_are_invalid(params, words):
    with pytest.raises(InvalidArgument, match=words) as error:
        SamplingParams(**params).validate()
    assert error.value.field == "bad_words"


def test_the_gateway_passes_bad_words_and_the_service_names_them(http: httpx.Client, fake):
    assert http.post("/v1/chat/completions", json=chat_body(bad_words=["Paris", "Lyon"])).status_code == 200
    assert list(fake.requests[-1].sampling.bad_words) == ["Paris", "Lyon"]

    async def body(h):
        request = text_request("abc", max_tokens=2)
        request.sampling.bad_words.append(" ")
        return await code_of(h.stub.Generate(request))

    code, details = run(body)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "bad_words must be non-blank" in details
