"""GPU: the structured-output engine tests (tests/unit/test_structured_engine.py) on the CUDA
backend, on a tiny model whose head_dim (64) the GPU's decode kernel takes: the mask at work under
chunked prefill, preemption and n, JSON schemas, stop strings and tokens, grammar work limits,
unconstrained rows beside constrained ones, seeds, EOS and max_tokens. Each test is the CPU one,
run with the engines it builds on the GPU (the CUDA sampler applies the packed bitmask)."""
from __future__ import annotations

import pytest

from tests.kernels.helpers import engines_on
from tests.tiny_models import (CHATML_TEMPLATE, GPU_SIZES, random_weights, tiny_arch, tiny_tokenizer_json,
                               write_safetensors_dir)
from tests.unit import test_structured_engine as structured_tests
from tests.unit.test_structured_engine import llm  # noqa: F401 (a fixture)

pytestmark = pytest.mark.gpu
DEVICE = "cuda"
on_the_gpu = engines_on(DEVICE, structured_tests)  # llm's engine among them


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    arch = tiny_arch(**GPU_SIZES)
    root = tmp_path_factory.mktemp("tiny_gpu_structured")
    write_safetensors_dir(root, arch, random_weights(arch, seed=5), tokenizer_json=tiny_tokenizer_json(),
                          chat_template=CHATML_TEMPLATE)
    return root


def test_the_engines_are_on_the_gpu(tiny_dir, llm):
    assert structured_tests.LLM(model=str(tiny_dir), dtype="float32").engine.runner.device.type == DEVICE
    assert llm.engine.runner.device.type == DEVICE


test_regex_outputs_match_under_chunked_prefill_preemption_and_n = \
    structured_tests.test_regex_outputs_match_under_chunked_prefill_preemption_and_n
test_json_schema_output_parses = structured_tests.test_json_schema_output_parses
test_a_stop_string_ends_constrained_output_only_where_it_is_complete = \
    structured_tests.test_a_stop_string_ends_constrained_output_only_where_it_is_complete
test_a_stop_string_still_ends_constrained_output_where_the_grammar_may_end = \
    structured_tests.test_a_stop_string_still_ends_constrained_output_where_the_grammar_may_end
test_stop_token_ids_other_than_eos_are_refused_with_a_constraint = \
    structured_tests.test_stop_token_ids_other_than_eos_are_refused_with_a_constraint
test_a_grammar_that_hits_a_work_limit_mid_output_ends_only_its_own_request = \
    structured_tests.test_a_grammar_that_hits_a_work_limit_mid_output_ends_only_its_own_request
test_unconstrained_rows_equal_their_solo_runs = structured_tests.test_unconstrained_rows_equal_their_solo_runs
test_seeded_constrained_output_does_not_depend_on_the_batch = \
    structured_tests.test_seeded_constrained_output_does_not_depend_on_the_batch
test_a_complete_choice_ends_with_eos_even_with_ignore_eos = \
    structured_tests.test_a_complete_choice_ends_with_eos_even_with_ignore_eos
test_max_tokens_first_is_length_never_stop = structured_tests.test_max_tokens_first_is_length_never_stop
test_a_refused_token_aborts_the_request = structured_tests.test_a_refused_token_aborts_the_request
