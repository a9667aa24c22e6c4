"""The CPU backend's fused decode (every layer of a decode step in one native call) against the
per-kernel path it replaces, on the default model: the same tokens and logprobs, bit for bit."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from forge_service import LLM, SamplingParams
from forge_service.backends import cpu_kernels
from forge_service.backends.base import AttentionMetadata

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(cpu_kernels.library() is None,
                                                   reason="the native CPU kernels cannot run on this machine")]


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    # outputs of different lengths, so that the decode batch shrinks from all of them to one
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, logprobs=4, ignore_eos=True)
              for i in range(len(prompts))]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [(o.token_ids, [[(lp.token_id, lp.logprob) for lp in pos] for pos in o.logprobs]) for o in outs]


def test_fused_decode_equals_the_per_kernel_path(fidelity_prompt_ids):
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False)
    model = llm.engine.runner.model
    plan = model.decode_plan
    assert plan is not None
    calls = []
    model.decode_plan = lambda *args: calls.append(len(args[0])) or plan(*args)
    model.decode_plan.takes = plan.takes
    prompts = fidelity_prompt_ids[:5] + fidelity_prompt_ids[14:19]  # 10 of mixed lengths
    fused = _run(llm, prompts)
    assert set(calls) == set(range(1, len(prompts) + 1))  # every batch size on the way down
    model.decode_plan = None
    assert _run(llm, prompts) == fused


def test_the_plan_takes_decode_steps_of_any_size_and_nothing_else(llm_fp32):
    engine = LLM(dtype="bfloat16").engine
    plan = engine.runner.model.decode_plan
    # its GEMMs' blocks of rows (ROWS in native/cpu/quant_gemm.c), which bound drafts in the scheduler
    rows = re.search(r"#define ROWS (\d+)", (ROOT / "native/cpu/quant_gemm.c").read_text())
    assert plan.row_block == engine.scheduler.row_block == int(rows[1])
    decode = AttentionMetadata(slot_mapping=torch.zeros(4, dtype=torch.long), block_size=16, num_decode_tokens=4,
                               decode_lens=torch.ones(4, dtype=torch.int32))
    assert plan.takes(decode, 4)
    assert not plan.takes(decode, 5)  # a prefill chunk rides along
    big = AttentionMetadata(slot_mapping=torch.zeros(64, dtype=torch.long), block_size=16, num_decode_tokens=64,
                            decode_lens=torch.ones(64, dtype=torch.int32))
    assert plan.takes(big, 64) and plan.max_rows is None  # the native GEMMs take every batch size
    assert llm_fp32.engine.runner.model.decode_plan is None  # fp32, the reference, stays in torch
