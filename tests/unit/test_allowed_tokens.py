"""allowed_token_ids (vLLM's sampling parameter): the output has only the listed tokens. The
sampler's mask, the tiny model's output with and without drafts, the checks, and the field
through the gateway."""
from __future__ import annotations

import httpx
import pytest
import torch

from forge_service import SamplingParams
from forge_service.errors import InvalidArgument
from forge_service.sampling import RowSampling, Sampler, SamplingMetadata
from forge_service.structured import Constraint
from tests.unit.test_engine_tiny import tiny_dir  # noqa: F401 (a fixture: the sharp tiny model)
from tests.unit.test_gateway import chat_body, fake, http, stack  # noqa: F401 (fixtures)
from tests.unit.test_min_tokens import EOS, engines  # noqa: F401 (a fixture: the tiny model without and with drafts)
from tests.unit.test_speculative_engine import LOOPING


def test_the_sampler_picks_among_the_allowed_tokens_only():
    """Row 0 may take 3 or 7 only: its argmax (token 0) and its samples stay among them; row 1, with
    no list, is untouched."""
    logits = torch.zeros(2, 16)
    logits[:, 0] = 10.0
    logits[0, 7] = 1.0
    rows = [RowSampling(SamplingParams(temperature=0), [1], [], allowed=torch.tensor([3, 7])),
            RowSampling(SamplingParams(temperature=0), [1], [])]
    out = Sampler()(logits, SamplingMetadata.build(rows, 16))
    assert out.token_ids.tolist() == [7, 0]
    sampled = [RowSampling(SamplingParams(temperature=1.0), [1], [], allowed=torch.tensor([3, 7]))] * 64
    tokens = Sampler()(logits[:1].expand(64, 16).contiguous(), SamplingMetadata.build(sampled, 16)).token_ids.tolist()
    assert set(tokens) <= {3, 7} and len(set(tokens)) == 2


def test_the_output_has_only_the_allowed_tokens(engines):  # noqa: F811
    """A greedy output's own later tokens, allowed alone: every token is one of them, the same
    with drafts on; without EOS in the list generation runs to max_tokens."""
    off, on = engines
    params = dict(temperature=0, max_tokens=30)
    base = off.generate(LOOPING, SamplingParams(**params, ignore_eos=True))
    allowed = sorted(set(base[0].outputs[0].token_ids[-6:]))
    limited = SamplingParams(**params, allowed_token_ids=allowed)
    want, got = off.generate(LOOPING, limited), on.generate(LOOPING, limited)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    for w in want:
        assert set(w.outputs[0].token_ids) <= set(allowed) and len(w.outputs[0].token_ids) == 30
    assert want[1].outputs[0].token_ids != base[1].outputs[0].token_ids  # the list changed something
    [eos] = off.generate([LOOPING[0]], SamplingParams(**params, allowed_token_ids=[EOS], min_tokens=0))
    assert eos.outputs[0].token_ids == [EOS] and eos.outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("params, words", [
    (dict(allowed_token_ids=[]), "at least one token"),
    (dict(allowed_token_ids=[5, 999]), "allowed_token_ids entry 999 is outside the vocabulary"),
    (dict(allowed_token_ids=[5], bad_words=["a"]), "cannot be combined with bad_words"),
    (dict(allowed_token_ids=[5], constraint=Constraint("regex", "a+")), "cannot be combined with structured"),
])
def test_allowed_token_ids_out_of_bounds_are_invalid(params, words):
    with pytest.raises(InvalidArgument, match=words) as error:
        SamplingParams(**params).validate(vocab_size=320)
    assert error.value.field == "allowed_token_ids"


def test_only_stop_tokens_under_min_tokens_are_refused(engines):  # noqa: F811
    with pytest.raises(InvalidArgument, match="only stop tokens") as error:
        engines[0].engine.validate([5, 6], SamplingParams(allowed_token_ids=[EOS], min_tokens=2, max_tokens=4))
    assert error.value.field == "allowed_token_ids"


def test_the_gateway_passes_allowed_token_ids(http: httpx.Client, fake):
    assert http.post("/v1/chat/completions", json=chat_body(allowed_token_ids=[5, 9])).status_code == 200
    assert list(fake.requests[-1].sampling.allowed_token_ids) == [5, 9]
    for bad in ([], [-1]):
        refused = http.post("/v1/chat/completions", json=chat_body(allowed_token_ids=bad))
        assert refused.status_code == 400 and refused.json()["error"]["param"].startswith("allowed_token_ids")
