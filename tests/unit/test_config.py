"""Settings out of range or unreadable fail at start, naming the setting; good ones still read."""
from __future__ import annotations

import pytest

from forge_gateway.config import gateway_config_from_env
from forge_service.config import engine_config_from_env, service_config_from_env


@pytest.mark.parametrize("field, value", [
    ("max_num_seqs", 0),  # no sequence could ever be scheduled: every request would wait forever
    ("max_num_batched_tokens", 0),
    ("max_tokens_while_decoding", -1),
    ("max_step_ms_while_decoding", -1.0),
    ("max_step_ms_while_decoding", float("nan")),  # would pass a plain `< 0` test, then fail every step
    ("spec_step_base_rows", float("nan")),
    ("max_waiting", -1),
    ("block_size", 0),
    ("kv_cache_bytes", 0),
    ("num_blocks", 0),
    ("max_model_len", 0),
    ("max_grammar_bytes", 0),
    ("grammar_compile_timeout_s", 0.0),
    ("num_threads", -1),
])
def test_an_engine_setting_out_of_range_is_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        engine_config_from_env({}, **{field: value})


@pytest.mark.parametrize("field, value", [
    ("grpc_port", 70000), ("http_port", -1), ("metrics_port", 65536), ("drain_timeout_s", -1.0),
    ("tokenizer_workers", 0), ("max_pending_tokenize", 0),
])
def test_a_service_setting_out_of_range_is_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        service_config_from_env({}, **{field: value})


@pytest.mark.parametrize("field, value", [
    ("http_port", 65536), ("request_timeout_s", 0.0), ("ready_timeout_s", -1.0), ("max_n", 0),
    ("max_body_bytes", 0), ("max_stop", -1),
])
def test_a_gateway_setting_out_of_range_is_refused_by_name(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        gateway_config_from_env({}, **{field: value})


def test_the_edges_of_the_ranges_are_accepted() -> None:
    engine = engine_config_from_env({}, max_num_seqs=1, max_waiting=0, max_tokens_while_decoding=0, num_threads=0)
    assert (engine.scheduler.max_num_seqs, engine.scheduler.max_waiting) == (1, 0)
    service = service_config_from_env({}, grpc_port=0, http_port=65535, metrics_port=0, drain_timeout_s=0.0)
    assert (service.grpc_port, service.http_port) == (0, 65535)
    assert gateway_config_from_env({}, http_port=0, ready_timeout_s=0.0).ready_timeout_s == 0.0


@pytest.mark.parametrize("env, message", [
    ({"FORGE_KV_CACHE_BYTES": "1GiB"}, "FORGE_KV_CACHE_BYTES='1GiB': invalid literal for int()"),
    ({"FORGE_MAX_MODEL_LEN": "4k"}, "FORGE_MAX_MODEL_LEN='4k': invalid literal for int()"),
    ({"FORGE_ENABLE_PREFIX_CACHING": "flase"}, "FORGE_ENABLE_PREFIX_CACHING='flase': expected one of 1, true"),
    ({"FORGE_MAX_NUM_SEQS": "0"}, "max_num_seqs must be >= 1, got 0"),
])
def test_an_unreadable_variable_is_refused_by_name(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError) as error:
        engine_config_from_env(env)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("text, value", [("1", True), ("ON", True), ("yes", True), ("0", False), ("off", False),
                                         ("False", False), ("", False)])
def test_boolean_variables_read_their_usual_spellings(text: str, value: bool) -> None:
    assert engine_config_from_env({"FORGE_ENABLE_PREFIX_CACHING": text}).cache.enable_prefix_caching is value
