"""GPU, end to end on the default model: greedy decoding on the CUDA backend (decode steps
replayed from CUDA graphs) agrees with the CPU backend's float32 model on >= 99% of steps (>= 98%
when the GPU runs bfloat16), each step judged on the same prefix (the GPU's own output, fed to the
CPU model)."""
from __future__ import annotations

import pytest
import torch

from forge_service import LLM, SamplingParams
from forge_service.backends.base import AttentionMetadata, PrefillSeq

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
PROMPTS = [
    "The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a small village,",
    "The three primary colors are", "import numpy as np\nx = np.array([1, 2, 3])\n",
    "Water boils at a temperature of", "The best way to learn a new language is", "1, 2, 3, 4, 5,",
    "Dear hiring manager,\n\nI am writing to", "Café, naïve, résumé: these words come from",
]
NEW_TOKENS = 64
# Steps whose greedy token the CPU's fp32 model also ranks first. bf16 activations flip near-ties:
# the CPU's own default bf16 path scores 633 of 640 (0.989) on these prompts, as did the H200.
MIN_AGREEMENT = {"float32": 0.99, "bfloat16": 0.98}


@pytest.fixture(scope="module")
def cpu_fp32() -> LLM:
    return LLM(dtype="float32")


def teacher_forced_top1(llm: LLM, token_ids: list[int]) -> list[int]:
    """argmax of the next-token logits after every prefix, from one prefill of the whole sequence
    (into the idle engine's first blocks)."""
    runner = llm.engine.runner
    n, device = len(token_ids), runner.device
    meta = AttentionMetadata(slot_mapping=torch.arange(n), block_size=runner.block_size, num_decode_tokens=0,
                             prefills=[PrefillSeq(0, n)])
    with torch.inference_mode():
        logits = runner.forward(torch.tensor(token_ids, device=device), torch.arange(n, device=device),
                                runner.backend.prepare(meta), torch.arange(n, device=device))
    return logits.argmax(-1).tolist()


def agreement(reference: LLM, outputs) -> float:
    same = total = 0
    for out in outputs:
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        top1 = teacher_forced_top1(reference, ids)
        start = len(out.prompt_token_ids)
        same += sum(top1[i - 1] == ids[i] for i in range(start, len(ids)))
        total += len(ids) - start
    return same / total


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_agrees_with_cpu_fp32(cpu_fp32, dtype):
    gpu = LLM(dtype=dtype, device="cuda", max_num_seqs=16)
    assert gpu.engine.runner.backend.graphs is not None and 16 in gpu.engine.runner.backend.graphs.graphs
    outputs = gpu.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    assert all(len(o.outputs[0].token_ids) == NEW_TOKENS for o in outputs)
    assert agreement(cpu_fp32, outputs) >= MIN_AGREEMENT[dtype]
    # Graph-replayed decode steps against the GPU's own eager prefill of the same tokens.
    assert agreement(gpu, outputs) >= 0.99


def test_seeded_sampling_is_reproducible_and_batch_invariant():
    gpu = LLM(dtype="bfloat16", device="cuda", max_num_seqs=8)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = gpu.generate(PROMPTS[0], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    batch = gpu.generate(PROMPTS[:4], [seeded, others, others, others])[0].outputs[0].token_ids
    assert alone == batch
    assert gpu.generate(PROMPTS[0], SamplingParams(temperature=0.9, seed=99, max_tokens=24,
                                                   ignore_eos=True))[0].outputs[0].token_ids != alone


def test_greedy_tokens_do_not_depend_on_the_batch_the_prefix_cache_or_speculation():
    """bf16 on the GPU: a request's greedy tokens are the same in a batch of 12, alone, after its
    prompt hit the prefix cache, and verified from n-gram drafts (k + 1 rows where a decode runs 1)."""
    prompts = PROMPTS + ["Repeat after me: the quick brown fox jumps over the lazy dog. The quick brown fox",
                         "List: apple, banana, cherry, apple, banana, cherry, apple,"]
    greedy = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    plain = LLM(dtype="bfloat16", device="cuda", max_num_seqs=32, speculative="off")
    batch = [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)]
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, greedy)] == batch  # prompts now cached
    assert [plain.generate(p, greedy)[0].outputs[0].token_ids for p in prompts] == batch
    del plain
    drafting = LLM(dtype="bfloat16", device="cuda", max_num_seqs=32, speculative="ngram")
    alone = [drafting.generate(p, greedy)[0].outputs[0] for p in prompts]
    assert sum(o.num_accepted_tokens for o in alone) > len(prompts) * 8  # drafts were verified and kept
    assert [o.token_ids for o in alone] == batch
