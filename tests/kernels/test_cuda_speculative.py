"""GPU: the speculative-decoding engine tests (tests/unit/test_speculative_engine.py) on the CUDA
backend, in float32 on tiny models whose head_dim (64) the GPU's decode kernel takes: greedy and
seeded outputs unchanged by speculation in mixed batches with preemption and prefix hits, the
per-request opt-out and caps, KV rollback, stops inside an accepted run, structured output, and the
sampled law (chi-square, with the wrong verifier caught)."""
from __future__ import annotations

import functools

import pytest

from forge_service import LLM
from tests.tiny_models import random_weights, tiny_arch, tiny_tokenizer_json, write_safetensors_dir
from tests.unit import test_speculative_engine as engine_tests
from tests.unit.test_engine_tiny import CHATML_TEMPLATE, sharp_weights

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
GPU_ARCH = dict(hidden_size=256, intermediate_size=512, num_heads=4, num_kv_heads=2)  # head_dim 64
# The tests rely on the model's greedy loops (drafts accepted, a stop string inside an accepted
# run): seed 1's weights at this size have them on the CPU backend (seeds 2 and 3 do not).


@pytest.fixture(autouse=True)
def on_the_gpu(monkeypatch):
    monkeypatch.setattr(engine_tests, "LLM", functools.partial(LLM, device=DEVICE))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    arch = tiny_arch(**GPU_ARCH)
    root = tmp_path_factory.mktemp("tiny_gpu")
    write_safetensors_dir(root, arch, sharp_weights(arch, seed=1), tokenizer_json=tiny_tokenizer_json(),
                          chat_template=CHATML_TEMPLATE)
    return root


@pytest.fixture(scope="module")
def unigram_dir(tmp_path_factory):
    arch = tiny_arch(**GPU_ARCH)
    root = tmp_path_factory.mktemp("tiny_gpu_unigram")
    w = random_weights(arch, seed=5)
    embed = w["model.embed_tokens.weight"]
    w["model.embed_tokens.weight"] = embed[:1].expand_as(embed).clone()
    write_safetensors_dir(root, arch, w, tokenizer_json=tiny_tokenizer_json())
    return root


test_mixed_batch_with_preemption_and_prefix_cache_is_unchanged = \
    engine_tests.test_mixed_batch_with_preemption_and_prefix_cache_is_unchanged
test_a_request_can_opt_out = engine_tests.test_a_request_can_opt_out
test_drafts_stay_within_the_per_request_and_per_step_caps = \
    engine_tests.test_drafts_stay_within_the_per_request_and_per_step_caps
test_rejected_drafts_leave_no_kv_behind = engine_tests.test_rejected_drafts_leave_no_kv_behind
test_stops_inside_an_accepted_run_cut_at_their_token = engine_tests.test_stops_inside_an_accepted_run_cut_at_their_token
test_structured_output_stays_valid_and_unchanged = engine_tests.test_structured_output_stays_valid_and_unchanged
test_sampled_tokens_follow_the_target_distribution = engine_tests.test_sampled_tokens_follow_the_target_distribution
test_a_draft_through_the_end_of_structured_output_stops_there = \
    engine_tests.test_a_draft_through_the_end_of_structured_output_stops_there


def test_the_engine_tests_build_their_engines_on_the_gpu(tiny_dir):
    assert engine_tests.LLM(model=str(tiny_dir), dtype="float32").engine.runner.device.type == DEVICE
