"""A prompt's output does not depend on what else is in the batch, however the batch is cut."""
from __future__ import annotations

import pytest

from forge_service import LLM, SamplingParams

pytestmark = pytest.mark.slow
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def prompts(fidelity_prompt_ids) -> list[list[int]]:
    """16 prompts of mixed lengths (8 to 60 tokens)."""
    mixed = fidelity_prompt_ids[:8] + fidelity_prompt_ids[12:20]
    assert len({len(p) for p in mixed}) > 8
    return mixed


def solo(llm: LLM, prompts, params_for) -> list[list[int]]:
    return [llm.generate([p], params_for(i))[0].outputs[0].token_ids for i, p in enumerate(prompts)]


def together(llm: LLM, prompts, params_for) -> list[list[int]]:
    outs = llm.generate(prompts, [params_for(i) for i in range(len(prompts))])
    return [o.outputs[0].token_ids for o in outs]


def greedy(_i: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def seeded(i: int) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(llm_fp32, prompts):
    return solo(llm_fp32, prompts, greedy)


def test_chunked_prefill_under_32_token_budget(prompts, reference):
    llm = LLM(dtype="float32", max_num_batched_tokens=32)
    assert max(len(p) for p in prompts) > 32  # some prompt really is chunked
    assert together(llm, prompts, greedy) == reference


def test_preemption_loses_nothing(prompts, reference):
    # 24 blocks of 16 tokens cannot hold 16 prompts of up to ~60 tokens plus 24 outputs each.
    llm = LLM(dtype="float32", num_blocks=24)
    assert together(llm, prompts, greedy) == reference
    assert llm.engine.num_preemptions > 0


def test_seeded_sampling_is_batch_invariant(llm_fp32, prompts):
    alone = solo(llm_fp32, prompts, seeded)
    assert together(llm_fp32, prompts, seeded) == alone
    # and the seed matters: a different seed gives a different sample somewhere
    other = together(llm_fp32, prompts, lambda i: SamplingParams(temperature=1.0, seed=7 + i,
                                                                   max_tokens=MAX_TOKENS, ignore_eos=True))
    assert other != alone


def _tokens_and_logprobs(llm: LLM, prompts, together_: bool, cached: list[int] | None = None
                         ) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(prompts, params) if together_ else [llm.generate([p], params)[0] for p in prompts]
    if cached is not None:
        cached += [o.num_cached_tokens for o in outs]
    return [(o.outputs[0].token_ids, [pos[0].logprob for pos in o.outputs[0].logprobs]) for o in outs]


def test_bf16_rows_are_bit_identical_whatever_shares_the_step_or_cuts_the_prompt(prompts):
    """The default bf16 path (native GEMMs at every batch size, the fused decode, the int8
    lm_head): each prompt alone, all 16 together, and prefilled 7 tokens a step beside the
    decodes, give the same tokens and the same logprobs to the bit; so does a prefix-cache hit."""
    alone = _tokens_and_logprobs(LLM(dtype="bfloat16", enable_prefix_caching=False), prompts, together_=False)
    batched = LLM(dtype="bfloat16", enable_prefix_caching=False)
    assert _tokens_and_logprobs(batched, prompts, together_=True) == alone
    chunked = LLM(dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=7)
    assert _tokens_and_logprobs(chunked, prompts, together_=True) == alone
    cached, hits = LLM(dtype="bfloat16"), []
    _tokens_and_logprobs(cached, prompts, together_=True)
    assert _tokens_and_logprobs(cached, prompts, together_=False, cached=hits) == alone
    # the second pass reused whole blocks, and copied the prompt's last block but its last token
    assert hits == [len(p) - 1 for p in prompts]
