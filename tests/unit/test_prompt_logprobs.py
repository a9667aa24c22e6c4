"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt token's logprob given the tokens
before it, on tiny fp32 models against transformers, across prefill chunks, prefix-cache hits,
preemption and n completions."""
from __future__ import annotations

import pytest
import torch

from forge_service import LLM, SamplingParams
from forge_service.errors import InvalidArgument
from tests.unit.test_engine_tiny import hf_logits, tiny_dir  # noqa: F401 (tiny_dir: a fixture)


def _check_against_transformers(prompt_logprobs, ids: list[int], ref: torch.Tensor, k: int) -> None:
    assert prompt_logprobs[0] is None and len(prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        chosen, *top = prompt_logprobs[p]
        row = ref[p - 1]
        assert chosen.token_id == ids[p]
        assert abs(chosen.logprob - float(row[ids[p]])) < 1e-4, p
        assert chosen.rank == int((row > row[ids[p]]).sum()) + 1
        assert [t.token_id for t in top] == row.topk(k).indices.tolist()
        assert [t.rank for t in top] == list(range(1, k + 1))


def test_prompt_logprobs_match_transformers_across_chunks(tiny_dir):
    ids = list(range(5, 150))  # 145 tokens: three prefill chunks under a 64-token budget
    llm = LLM(model=str(tiny_dir), dtype="float32", max_num_batched_tokens=64)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3))[0]
    ref = torch.log_softmax(hf_logits(tiny_dir, ids), -1)
    _check_against_transformers(out.prompt_logprobs, ids, ref, 3)
    assert out.outputs[0].token_ids[0] == int(ref[-1].argmax())  # the output is as without them
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids


def test_prompt_logprobs_compute_a_cached_prompt_and_leave_its_blocks_to_others(tiny_dir):
    ids = list(range(7, 90))
    llm = LLM(model=str(tiny_dir), dtype="float32", block_size=16)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    warm = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    first = llm.generate([ids], params)[0]  # its whole prompt is cached, yet every position is scored
    second = llm.generate([ids], params)[0]
    assert first.num_cached_tokens == second.num_cached_tokens == 0
    assert len(first.prompt_logprobs) == len(ids)
    assert [[e.logprob for e in entry] for entry in first.prompt_logprobs[1:]] == \
        [[e.logprob for e in entry] for entry in second.prompt_logprobs[1:]]
    assert all(len(entry) == 1 for entry in first.prompt_logprobs[1:])  # prompt_logprobs=0: the token alone
    assert first.outputs[0].token_ids == warm.outputs[0].token_ids
    after = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))[0]
    assert after.num_cached_tokens >= 80  # the blocks scored requests computed serve plain ones
    assert llm.engine.kv.num_used_blocks == 0


def test_prompt_logprobs_survive_preemption_and_come_once_for_n_completions(tiny_dir):
    prompts = [list(range(3 + i, 3 + i + 20 + 9 * i)) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, prompt_logprobs=2, n=2)
    big = LLM(model=str(tiny_dir), dtype="float32")
    alone = [big.generate([p], params)[0] for p in prompts]
    small = LLM(model=str(tiny_dir), dtype="float32", num_blocks=14, block_size=8, max_num_batched_tokens=32)
    together = small.generate(prompts, params)
    assert small.engine.num_preemptions > 0
    for a, t, p in zip(alone, together, prompts):
        assert len(t.prompt_logprobs) == len(p)
        for mine, solo in zip(t.prompt_logprobs[1:], a.prompt_logprobs[1:]):  # chunks differ: fp32 rounding
            assert [e.token_id for e in mine] == [e.token_id for e in solo]
            assert max(abs(x.logprob - y.logprob) for x, y in zip(mine, solo)) < 1e-4
        assert [o.token_ids for o in t.outputs] == [o.token_ids for o in a.outputs]
    assert small.engine.kv.num_used_blocks == 0


def test_a_one_token_prompt_has_only_its_none_entry(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32")
    out = llm.generate([[9]], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=4))[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range_are_refused_by_name(tiny_dir, value):
    llm = LLM(model=str(tiny_dir), dtype="float32")
    with pytest.raises(InvalidArgument) as error:
        llm.generate(["hi"], SamplingParams(prompt_logprobs=value))
    assert error.value.field == "prompt_logprobs"
