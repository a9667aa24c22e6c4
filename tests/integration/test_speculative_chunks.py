"""On the default model (bf16, the CPU's native kernels), a verified draft's rows are attended as one
prefill chunk, whose queries share each key load: tokens and logprobs are those of the same requests
with the draft's rows as decode rows, and without speculation, bit for bit, in a batch beside plain
decodes and prompt chunks."""
from __future__ import annotations

import pytest

from forge_service import LLM, SamplingParams
from forge_service.backends import cpu_kernels
from forge_service.runner import model_runner

pytestmark = [pytest.mark.slow, pytest.mark.skipif(cpu_kernels.library() is None,
                                                   reason="the native CPU kernels cannot run on this machine")]
COPY = ["Repeat this sentence exactly: the quick brown fox jumps over the lazy dog, and the lazy dog sleeps.",
        "Copy the list: apple, banana, cherry, date, elderberry, fig, grape, apple, banana, cherry, date,"]


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 8 * i, logprobs=3, ignore_eos=True)
              for i in range(len(prompts))]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [(o.token_ids, [[(lp.token_id, lp.logprob) for lp in pos] for pos in o.logprobs]) for o in outs]


def test_verified_drafts_attend_as_one_chunk_with_decode_rows_bits(fidelity_prompt_ids, monkeypatch):
    on = LLM(dtype="bfloat16", enable_prefix_caching=False, speculative="ngram", max_num_batched_tokens=64)
    assert on.engine.runner.drafts_as_chunks
    tokenizer = on.tokenizer
    prompts = [tokenizer.encode_chat([{"role": "user", "content": c}]) for c in COPY] + fidelity_prompt_ids[:4]
    routed = []  # (draft length, attended as decode rows) of every chunk after its prompt

    def recording(chunk, drafts_as_chunks):
        decode = is_decode(chunk, drafts_as_chunks)
        if chunk.start >= chunk.request.num_prompt_tokens:
            routed.append((len(chunk.draft), decode))
        return decode

    is_decode = model_runner._is_decode
    monkeypatch.setattr(model_runner, "_is_decode", recording)
    chunks = _run(on, prompts)
    assert any(draft and not decode for draft, decode in routed)  # verified as chunks
    assert not any(draft and decode for draft, decode in routed)
    assert any(not draft and decode for draft, decode in routed)  # plain decodes beside them
    copied = on.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))[0]
    assert copied.outputs[0].num_accepted_tokens >= 4  # drafts were kept, not only verified
    routed.clear()
    on.engine.runner.drafts_as_chunks = False
    assert _run(on, prompts) == chunks
    assert any(draft and decode for draft, decode in routed)  # verified as decode rows this time
    off = LLM(dtype="bfloat16", enable_prefix_caching=False, speculative="off", max_num_batched_tokens=64)
    assert _run(off, prompts) == chunks
