"""Random workloads on the sharp tiny model: whatever the block size, token budget, batch limit, KV
size (preemption), speculation and prefix cache (whole-block and partial hits, in a second round of
the same prompts), every request gets what it gets alone on a plain engine, greedy or seeded with
every sampling processor (its tokens, and their logprobs within 1e-4: this model's tokens alone
would survive a few lost keys), and every block goes back to the pool."""
from __future__ import annotations

import random

import pytest

from forge_service import LLM, SamplingParams
from tests.unit.test_engine_tiny import tiny_dir  # noqa: F401 (a fixture: the sharp tiny model)

WORKLOADS = 24


def workload(rnd: random.Random, sampled: bool) -> tuple[list[list[int]], list[SamplingParams], dict]:
    """Prompts that share prefixes of random lengths (some repetitive, so that drafts are accepted)
    and an engine configuration."""
    bases = [[rnd.randrange(3, 300) for _ in range(rnd.randrange(1, 40))] for _ in range(3)]
    prompts = []
    for _ in range(rnd.randrange(2, 12)):
        base = rnd.choice(bases)
        cut = rnd.randrange(0, len(base) + 1)
        tail = [rnd.randrange(3, 300) for _ in range(rnd.randrange(0 if cut else 1, 20))]
        prompts.append(base[:cut] + tail + (base[:8] * 3 if rnd.random() < 0.3 else []))

    def params() -> SamplingParams:
        if not sampled:
            return SamplingParams(temperature=0, max_tokens=rnd.randrange(1, 30), ignore_eos=True, logprobs=0)
        return SamplingParams(temperature=rnd.choice([0, 0.7, 1.2]), top_p=rnd.choice([1.0, 0.9]),
                              top_k=rnd.choice([0, 5]), min_p=rnd.choice([0.0, 0.05]),
                              repetition_penalty=rnd.choice([1.0, 1.3]), seed=rnd.randrange(10 ** 6),
                              max_tokens=rnd.randrange(1, 30), ignore_eos=True, logprobs=0)

    sampling = [params() for _ in prompts]
    config = dict(block_size=rnd.choice([4, 8, 16]), max_num_batched_tokens=rnd.choice([8, 16, 32, 64, 256]),
                  max_num_seqs=rnd.choice([2, 4, 32]), speculative=rnd.choice(["off", "ngram"]),
                  spec_step_base_rows=1e9)  # tiny steps cost the same at any row count: draft freely
    if rnd.random() < 0.5:  # room for the longest request and a few blocks more: preemption
        longest = max(len(p) + s.max_tokens for p, s in zip(prompts, sampling))
        config["num_blocks"] = -(-longest // config["block_size"]) + rnd.randrange(1, 6)
    return prompts, sampling, config


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_every_request_gets_its_solo_output(tiny_dir, sampled):
    plain = LLM(model=str(tiny_dir), dtype="float32", enable_prefix_caching=False)
    totals = {"preemptions": 0, "cached": 0, "accepted": 0}
    for seed in range(WORKLOADS):
        rnd = random.Random(seed)
        prompts, sampling, config = workload(rnd, sampled)
        want = [plain.generate([p], s)[0].outputs[0] for p, s in zip(prompts, sampling)]
        llm = LLM(model=str(tiny_dir), dtype="float32", **config)
        order = list(range(len(prompts)))
        for _ in range(2):  # the second round finds the prompts in the prefix cache
            rnd.shuffle(order)
            outs = llm.generate([prompts[i] for i in order], [sampling[i] for i in order])
            for i, out in zip(order, outs):
                got = out.outputs[0]
                assert got.token_ids == want[i].token_ids, (seed, config, i)
                assert [lp[0].logprob for lp in got.logprobs] == \
                    pytest.approx([lp[0].logprob for lp in want[i].logprobs], abs=1e-4), (seed, config, i)
            totals["cached"] += sum(o.num_cached_tokens for o in outs)
            totals["accepted"] += sum(o.outputs[0].num_accepted_tokens for o in outs)
        assert llm.engine.kv.num_used_blocks == 0, (seed, config)
        totals["preemptions"] += llm.engine.num_preemptions
    assert all(totals.values()), totals  # the workloads did preempt, hit the cache and accept drafts
