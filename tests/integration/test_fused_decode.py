"""The CPU backend's fused step (every layer of a step in one native call: decode rows and prefill
chunks) against the per-kernel path it replaces, on the default model: the same tokens and
logprobs, bit for bit."""
from __future__ import annotations

import ctypes
import re
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch

from forge_service import LLM, SamplingParams
from forge_service.backends import cpu_kernels
from forge_service.backends.base import AttentionMetadata, PrefillSeq
from tests.integration.serving.servers import torch_threads

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(cpu_kernels.library() is None,
                                                   reason="the native CPU kernels cannot run on this machine")]


def _run(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], list]]:
    # outputs of different lengths, so that the decode batch shrinks from all of them to one
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, logprobs=4, ignore_eos=True)
              for i in range(len(prompts))]
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [(o.token_ids, [[(lp.token_id, lp.logprob) for lp in pos] for pos in o.logprobs]) for o in outs]


def _chunks(meta) -> tuple[int, list[bool]]:
    """A step's decode rows, and for each prefill chunk whether it continues an earlier one."""
    return meta.num_decode_tokens, [seq.ctx_slots is not None for seq in meta.prefills]


def _recorded(model, describe: Callable = _chunks) -> list:
    """Swap in a plan that records each step it runs, as `describe` gives it."""
    plan, steps = model.decode_plan, []

    def run(x, cos, sin, kv_caches, meta):
        steps.append(describe(meta))
        return plan(x, cos, sin, kv_caches, meta)

    run.takes = plan.takes
    model.decode_plan = run
    return steps


def test_fused_decode_equals_the_per_kernel_path(fidelity_prompt_ids):
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.decode_plan is not None
    steps = _recorded(model)
    prompts = fidelity_prompt_ids[:5] + fidelity_prompt_ids[14:19]  # 10 of mixed lengths
    fused = _run(llm, prompts)
    decode_steps = {decodes for decodes, chunks in steps if not chunks}
    assert decode_steps == set(range(1, len(prompts) + 1))  # every batch size on the way down
    model.decode_plan = None
    assert _run(llm, prompts) == fused


def test_prefill_chunks_beside_decodes_get_the_per_kernel_path_s_bits(fidelity_prompt_ids):
    # A small token budget: prompts prefill in chunks that continue earlier ones, in steps where
    # the first requests already decode.
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=24)
    model = llm.engine.runner.model
    steps = _recorded(model)
    prompts = fidelity_prompt_ids[:6]
    fused = _run(llm, prompts)
    assert any(decodes and chunks for decodes, chunks in steps)  # mixed steps
    assert any(any(chunks) for _, chunks in steps)  # chunks after the first of their prompt
    assert any(not decodes and chunks for decodes, chunks in steps)  # prefill alone
    model.decode_plan = None
    assert _run(llm, prompts) == fused


def test_the_plan_takes_steps_of_any_size(llm_fp32):
    engine = LLM(dtype="bfloat16").engine
    plan = engine.runner.model.decode_plan
    # its GEMMs' blocks of rows (ROWS in native/cpu/quant_gemm.c), which bound drafts in the scheduler
    rows = re.search(r"#define ROWS (\d+)", (ROOT / "native/cpu/quant_gemm.c").read_text())
    assert plan.row_block == engine.scheduler.row_block == int(rows[1])
    decode = AttentionMetadata(slot_mapping=torch.zeros(4, dtype=torch.long), block_size=16, num_decode_tokens=4,
                               decode_lens=torch.ones(4, dtype=torch.int32))
    assert plan.takes(decode, 4)
    mixed = AttentionMetadata(slot_mapping=torch.zeros(9, dtype=torch.long), block_size=16, num_decode_tokens=4,
                              decode_lens=torch.ones(4, dtype=torch.int32), prefills=[PrefillSeq(4, 9)])
    assert plan.takes(mixed, 9)  # a prefill chunk rides along
    assert not plan.takes(AttentionMetadata(slot_mapping=torch.zeros(4, dtype=torch.long), block_size=16,
                                            num_decode_tokens=4), 4)  # decode rows without their lengths
    big = AttentionMetadata(slot_mapping=torch.zeros(64, dtype=torch.long), block_size=16, num_decode_tokens=64,
                            decode_lens=torch.ones(64, dtype=torch.int32))
    assert plan.takes(big, 64) and plan.max_rows is None  # the native GEMMs take every batch size
    assert llm_fp32.engine.runner.model.decode_plan is None  # fp32, the reference, stays in torch


@pytest.fixture
def two_threads() -> Iterator[None]:
    """The kernels on 2 threads, which the split by rows needs, whatever this machine's default."""
    with torch_threads(2):
        yield


def _drafting(count: int) -> tuple[LLM, list, list[list[int]]]:
    """An engine whose sequences mostly draft at every batch size (prompts that repeat a run of
    words, drafting priced as free: a step's fixed cost of 1,000 rows), the record of each decode
    step's rows and the sequences among them (None for steps with prefill chunks), and `count`
    prompts."""
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False, speculative="ngram", spec_step_base_rows=1000)
    # Row blocks off in the scheduler: a server drafts no more in steps of over one block of decodes,
    # but a step's few drafted decodes beside a prefill chunk are split by rows all the same, and here
    # the split is reached with drafts by decodes alone.
    llm.engine.scheduler.row_block = 1
    steps = _recorded(llm.engine.runner.model, lambda meta: None if meta.prefills else (
        meta.num_decode_tokens, len(torch.unique(meta.decode_block_tables, dim=0))))
    words = "red green blue yellow black white pink brown grey gold silver orange purple".split()
    prompts = [llm.tokenizer.encode(" ".join((words[i % 13:] + words[:i % 13])[:6] * 5)) for i in range(count)]
    return llm, steps, prompts


def test_steps_split_by_rows_between_threads_get_the_per_kernel_path_s_bits(two_threads):
    # Decode steps of more than 8 rows run on 2 threads split by rows (native/cpu/decode.c,
    # forge_split_rows), with drafts: a drafted sequence's rows stay on one thread.
    llm, steps, prompts = _drafting(24)
    model = llm.engine.runner.model
    fused = _run(llm, prompts)
    assert any(rows >= 16 and rows > sequences for rows, sequences in filter(None, steps))  # split, with drafts
    model.decode_plan = None
    assert _run(llm, prompts) == fused


class _Stalled:
    """The kernels' library, with each fused step's thread 0 held back `stall_s` at its start (as if
    preempted), counting the runs the threads hand each other."""

    def __init__(self, lib, stall_s: float) -> None:
        self.lib, self.stall_s, self.handoffs = lib, stall_s, ctypes.c_int64(0)

    def __getattr__(self, name: str):
        return getattr(self.lib, name)

    def forge_decode_layers(self, *args) -> int:
        return self.lib.forge_decode_layers_stalled(*args, self.stall_s, ctypes.byref(self.handoffs))


def test_a_thread_held_back_hands_rows_to_the_idle_one_with_the_same_bits(two_threads, monkeypatch):
    # A decode step split by rows: its thread 0 is held back, its thread 1 finishes and waits, and
    # thread 0 hands it the second half of its rows (a drafted sequence's rows together) at the next
    # layer; every row's tokens and logprobs stay those of the per-kernel path.
    llm, steps, prompts = _drafting(20)
    model = llm.engine.runner.model
    stalled = _Stalled(cpu_kernels.library(), stall_s=0.05)
    monkeypatch.setattr(cpu_kernels, "library", lambda: stalled)
    fused = _run(llm, prompts)
    monkeypatch.undo()
    assert stalled.handoffs.value > 0
    assert any(rows >= 16 and rows > sequences for rows, sequences in filter(None, steps))  # split, with drafts
    model.decode_plan = None
    assert _run(llm, prompts) == fused


def test_steps_with_prefill_chunks_split_by_rows_get_the_per_kernel_path_s_bits(fidelity_prompt_ids, two_threads):
    # Steps of more than 8 rows that carry prefill chunks split between 2 threads by rows, a chunk
    # into pieces on both (their threads meet after each layer's cache writes).
    llm = LLM(dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=40)
    model = llm.engine.runner.model
    steps = _recorded(model)
    prompts = fidelity_prompt_ids[:12]
    fused = _run(llm, prompts)
    assert any(decodes and chunks for decodes, chunks in steps)
    model.decode_plan = None
    assert _run(llm, prompts) == fused
