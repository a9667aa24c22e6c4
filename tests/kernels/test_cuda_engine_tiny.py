"""GPU: the engine tests on tiny models (tests/unit/test_engine_tiny.py, test_speculative_engine.py,
test_prompt_logprobs.py, test_structured_engine.py, and the sampling controls and priority tests:
test_min_tokens.py, test_bad_words.py, test_allowed_tokens.py, test_priority.py, and the Mistral, Qwen2,
Qwen3, SmolLM3 and Phi-3 checkpoints of test_model_variants.py) on the CUDA backend, on models whose head_dim
(64) the GPU's decode kernel takes: greedy decoding against transformers across chunks, batch against
solo under preemption, n and seeds, stops, prefix-cache hits (a block's first tokens copied; a
prompt's last token alone); prompt logprobs over a cached prompt and under preemption; speculation's
greedy and seeded outputs unchanged in mixed batches, opt-out and caps, KV rollback, stops inside an
accepted run, the sampled law (chi-square, the wrong verifier caught); structured output under
chunked prefill, preemption and n, JSON schemas, stops and grammar limits.

Each test is the CPU one, run with the engines it builds (its module's `LLM`) on the GPU."""
from __future__ import annotations

import pytest

from tests.kernels.helpers import engines_on
from tests.tiny_models import GPU_SIZES, tiny_arch, tiny_tokenizer_json, unigram_weights, write_safetensors_dir
from tests.unit import test_allowed_tokens as allowed_tests
from tests.unit import test_bad_words as bad_words_tests
from tests.unit import test_engine_tiny as tiny_tests
from tests.unit import test_min_tokens as min_tokens_tests
from tests.unit import test_model_variants as variant_tests
from tests.unit import test_priority as priority_tests
from tests.unit import test_prompt_logprobs as prompt_tests
from tests.unit import test_speculative_engine as engine_tests
from tests.unit.test_engine_tiny import CHATML_TEMPLATE, llm, sharp_weights  # noqa: F401 (llm: a fixture)
from tests.unit.test_min_tokens import engines  # noqa: F401 (a fixture: the tiny model without and with drafts)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
on_the_gpu = engines_on(DEVICE, tiny_tests, engine_tests, prompt_tests, min_tokens_tests,
                        priority_tests)  # llm's and engines' engines among them


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # The tests rely on the model's greedy loops (drafts accepted, a stop string inside an accepted
    # run): seed 1's weights at this size have them on the CPU backend (seeds 2 and 3 do not).
    arch = tiny_arch(**GPU_SIZES)
    root = tmp_path_factory.mktemp("tiny_gpu")
    write_safetensors_dir(root, arch, sharp_weights(arch, seed=1), tokenizer_json=tiny_tokenizer_json(),
                          chat_template=CHATML_TEMPLATE)
    return root


@pytest.fixture(scope="module")
def unigram_dir(tmp_path_factory):
    arch = tiny_arch(**GPU_SIZES)
    root = tmp_path_factory.mktemp("tiny_gpu_unigram")
    write_safetensors_dir(root, arch, unigram_weights(arch, seed=5), tokenizer_json=tiny_tokenizer_json())
    return root


test_greedy_decode_matches_transformers_across_chunks = tiny_tests.test_greedy_decode_matches_transformers_across_chunks
test_batch_equals_solo_with_preemption = tiny_tests.test_batch_equals_solo_with_preemption
test_n_completions_and_seeds = tiny_tests.test_n_completions_and_seeds
test_stop_token_ids_and_eos = tiny_tests.test_stop_token_ids_and_eos
test_stop_string_cuts_text = tiny_tests.test_stop_string_cuts_text
test_bf16_follows_fp32 = tiny_tests.test_bf16_follows_fp32
test_prefix_caching_reuses_blocks_without_changing_outputs = tiny_tests.test_prefix_caching_reuses_blocks_without_changing_outputs
test_a_prefix_that_ends_inside_a_block_is_copied_not_recomputed = \
    tiny_tests.test_a_prefix_that_ends_inside_a_block_is_copied_not_recomputed
test_a_prompt_s_last_token_alone_takes_the_prefill_path = tiny_tests.test_a_prompt_s_last_token_alone_takes_the_prefill_path
test_prompt_logprobs_compute_a_cached_prompt_and_leave_its_blocks_to_others = \
    prompt_tests.test_prompt_logprobs_compute_a_cached_prompt_and_leave_its_blocks_to_others
test_prompt_logprobs_survive_preemption_and_come_once_for_n_completions = \
    prompt_tests.test_prompt_logprobs_survive_preemption_and_come_once_for_n_completions

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

test_no_stop_token_is_sampled_among_the_first_min_tokens = \
    min_tokens_tests.test_no_stop_token_is_sampled_among_the_first_min_tokens
test_drafted_runs_keep_min_tokens_and_change_nothing_else = \
    min_tokens_tests.test_drafted_runs_keep_min_tokens_and_change_nothing_else
test_stop_strings_are_looked_for_after_the_first_min_tokens = \
    min_tokens_tests.test_stop_strings_are_looked_for_after_the_first_min_tokens
test_the_output_never_contains_a_bad_word = bad_words_tests.test_the_output_never_contains_a_bad_word
test_the_output_has_only_the_allowed_tokens = allowed_tests.test_the_output_has_only_the_allowed_tokens
test_preempted_low_priority_output_is_unchanged = priority_tests.test_preempted_low_priority_output_is_unchanged


@pytest.mark.parametrize("variant", ["mistral", "qwen2", "qwen3", "smollm3", "phi3"])
def test_each_architecture_decodes_as_transformers(tmp_path, variant):
    # Qwen2's biases and Qwen3's head norms are torch ops on this backend, in its decode graphs
    variant_tests.greedy_decode_equals_transformers(tmp_path, variant, device=DEVICE, **GPU_SIZES)


def test_the_engine_tests_build_their_engines_on_the_gpu(tiny_dir, llm, engines):
    for module in (tiny_tests, engine_tests):
        assert module.LLM(model=str(tiny_dir), dtype="float32").engine.runner.device.type == DEVICE
    assert llm.engine.runner.device.type == DEVICE
    assert all(e.engine.runner.device.type == DEVICE for e in engines)
