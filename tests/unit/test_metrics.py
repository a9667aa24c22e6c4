"""The engine's Prometheus metrics on a tiny random-weight Llama: every count exact."""
from __future__ import annotations

import pytest

from forge_service import LLM, SamplingParams
from forge_service.metrics import ServiceMetrics, batch_size_label
from forge_service.speculative.step_cost import PRIOR_BASE_ROWS, REFIT_EVERY
from tests.tiny_models import CHATML_TEMPLATE, random_weights, tiny_arch, tiny_tokenizer_json, write_safetensors_dir

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    arch = tiny_arch()
    root = tmp_path_factory.mktemp("tiny-metrics")
    write_safetensors_dir(root, arch, random_weights(arch), tokenizer_json=tiny_tokenizer_json(),
                          chat_template=CHATML_TEMPLATE)
    return root


def observed(llm: LLM) -> ServiceMetrics:
    metrics = ServiceMetrics()
    llm.engine.observer = metrics.watch(MODEL, llm.engine.stats)
    return metrics


def value(metrics: ServiceMetrics, name: str, **labels: str) -> float:
    got = metrics.registry.get_sample_value(name, {"model_name": MODEL, **labels})
    return 0.0 if got is None else got


def test_token_and_request_counters_equal_the_outputs(tiny_dir) -> None:
    llm = LLM(model=str(tiny_dir), dtype="float32", max_num_batched_tokens=32)
    metrics = observed(llm)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 17)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=1, max_tokens=9, n=3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)]
    outs = llm.generate(prompts, params)
    completions = [c for out in outs for c in out.outputs]
    generated = sum(len(c.token_ids) for c in completions)
    assert generated == 6 + 3 * 9 + 4
    assert value(metrics, "forge_generation_tokens_total") == generated
    assert value(metrics, "forge_prompt_tokens_total") == 5 + 40 + 17  # once per prompt, n or not
    assert value(metrics, "forge_requests_finished_total", finished_reason="length") == len(completions) == 5
    assert value(metrics, "forge_requests_finished_total", finished_reason="stop") == 0
    for name in ("forge_time_to_first_token_seconds", "forge_e2e_request_latency_seconds",
                 "forge_request_queue_time_seconds", "forge_request_prefill_time_seconds",
                 "forge_request_decode_time_seconds", "forge_request_generation_tokens"):
        assert value(metrics, name + "_count") == len(completions), name
    assert value(metrics, "forge_inter_token_latency_seconds_count") == generated - len(completions)
    assert value(metrics, "forge_request_prompt_tokens_count") == 3
    assert value(metrics, "forge_request_prompt_tokens_sum") == 62
    assert value(metrics, "forge_request_generation_tokens_sum") == generated
    steps = value(metrics, "forge_engine_step_batch_size_count")
    assert steps >= 9  # one token per step: 9 tokens take at least 9 steps
    by_batch = sum(value(metrics, "forge_engine_step_duration_seconds_count", batch_size=label)
                   for label in ("1", "2", "4", "8"))
    assert by_batch == steps
    assert value(metrics, "forge_num_requests_running") == 0 and value(metrics, "forge_num_requests_waiting") == 0
    assert value(metrics, "forge_kv_cache_blocks_used") == 0
    assert value(metrics, "forge_kv_cache_blocks_total") == llm.engine.runner.num_blocks


def test_prefix_cache_hits_and_preemptions_are_counted(tiny_dir) -> None:
    llm = LLM(model=str(tiny_dir), dtype="float32", block_size=4, num_blocks=14, max_num_batched_tokens=64)
    metrics = observed(llm)
    prompt = list(range(3, 23))  # 20 tokens: 5 blocks of 4
    greedy = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], greedy)
    assert value(metrics, "forge_prefix_cache_queried_tokens_total") == 20
    assert value(metrics, "forge_prefix_cache_hit_tokens_total") == 0
    llm.generate([prompt], greedy)
    assert value(metrics, "forge_prefix_cache_queried_tokens_total") == 40
    assert value(metrics, "forge_prefix_cache_hit_tokens_total") == 19  # 4 full blocks, 3 tokens of the last
    # Two requests growing to 40 tokens (10 blocks) each cannot both stay in 14 blocks.
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    outs = llm.generate([list(range(30, 50)), list(range(60, 80))], long)
    assert llm.engine.num_preemptions > 0
    assert value(metrics, "forge_preemptions_total") == llm.engine.num_preemptions
    assert value(metrics, "forge_generation_tokens_total") == 2 + 2 + sum(len(o.outputs[0].token_ids) for o in outs)


def test_an_aborted_request_counts_as_abort_and_leaves_the_gauges_at_zero(tiny_dir) -> None:
    llm = LLM(model=str(tiny_dir), dtype="float32")
    metrics = observed(llm)
    engine = llm.engine
    engine.add_request("a", list(range(3, 13)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("b", list(range(3, 9)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert value(metrics, "forge_num_requests_running") == 2
    engine.abort_request("a")
    engine.abort_request("b", "error")
    assert value(metrics, "forge_requests_finished_total", finished_reason="abort") == 1
    assert value(metrics, "forge_requests_finished_total", finished_reason="error") == 1
    assert value(metrics, "forge_generation_tokens_total") == 4
    assert value(metrics, "forge_num_requests_running") == 0
    assert value(metrics, "forge_kv_cache_blocks_used") == 0


def test_batch_size_labels_are_powers_of_two() -> None:
    assert [batch_size_label(b) for b in (1, 2, 3, 4, 5, 64, 65, 512, 513)] == \
        ["1", "2", "4", "4", "8", "64", "128", "512", "512+"]


@pytest.mark.parametrize("poison", ["raise_in_model", "raise_in_admission", "raise_in_output"])
def test_a_failed_request_counts_one_error_and_its_sibling_one_abort(tiny_dir, poison) -> None:
    from tests.unit import test_engine_isolation as isolation

    llm = LLM(model=str(tiny_dir), dtype="float32")
    metrics = observed(llm)
    engine = llm.engine
    engine.add_request("ok", list(range(3, 20)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()
    getattr(isolation, poison)(engine)  # the poison: n=2, one completion of it makes the engine raise
    emitted = 0
    while engine.has_unfinished_requests():
        emitted += sum(len(o.token_ids) for delta in engine.step() for o in delta.outputs)
    emitted += 1  # the first step's token
    assert value(metrics, "forge_requests_finished_total", finished_reason="error") == 1
    assert value(metrics, "forge_requests_finished_total", finished_reason="abort") == 1
    assert value(metrics, "forge_requests_finished_total", finished_reason="length") == 1
    assert value(metrics, "forge_generation_tokens_total") == emitted
    assert value(metrics, "forge_num_requests_running") == 0 and value(metrics, "forge_num_requests_waiting") == 0
    assert value(metrics, "forge_kv_cache_blocks_used") == 0


def test_the_drafting_cost_model_s_base_is_a_gauge(tiny_dir) -> None:
    off = LLM(model=str(tiny_dir), dtype="float32")
    drafting = LLM(model=str(tiny_dir), dtype="float32", speculative="ngram")
    fixed = LLM(model=str(tiny_dir), dtype="float32", speculative="ngram", spec_step_base_rows=3.5)
    assert value(observed(off), "forge_spec_decode_step_base_rows") == 0.0
    assert value(observed(fixed), "forge_spec_decode_step_base_rows") == 3.5
    metrics = observed(drafting)
    assert value(metrics, "forge_spec_decode_step_base_rows") == PRIOR_BASE_ROWS  # nothing measured yet
    for _ in range(REFIT_EVERY):
        for rows in (1, 5):  # decode steps of 7.25 ms and a millisecond a row
            drafting.engine.scheduler.step_cost.observe(rows, (7.25 + rows) / 1000)
    assert value(metrics, "forge_spec_decode_step_base_rows") == pytest.approx(7.25)
