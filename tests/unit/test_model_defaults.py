"""--generation-config auto: the sampling fields a request leaves unset take the model's own values
(generation_config.json, GGUF general.sampling.*); values the model sets wrongly are left out."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from forge_service import convert
from forge_service.config import EngineConfig, ModelConfig
from forge_service.engine.engine import LLMEngine
from forge_service.pb import forge_pb2 as pb
from forge_service.sampling.model_defaults import model_sampling_defaults
from tests.tiny_models import random_weights, tiny_arch, tiny_tokenizer_json, write_gguf, write_safetensors_dir


def hf_model(root: Path, generation: dict) -> Path:
    arch = tiny_arch()
    return write_safetensors_dir(root, arch, random_weights(arch), tokenizer_json=tiny_tokenizer_json(),
                                 generation=generation)


def test_a_hugging_face_model_s_generation_config(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = hf_model(tmp_path, {"temperature": 0.6, "top_k": 20, "top_p": 0.0, "min_p": "low",
                               "repetition_penalty": 1.1, "do_sample": True, "max_new_tokens": 9})
    with caplog.at_level(logging.WARNING):
        assert model_sampling_defaults(str(root)) == {"temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "top_p=0.0 is not used: top_p must be in (0, 1]" in warned and "min_p='low' is not used" in warned
    assert model_sampling_defaults(str(hf_model(tmp_path / "none", {}))) == {}


def test_a_gguf_s_general_sampling_keys(tmp_path: Path) -> None:
    arch = tiny_arch()
    path = write_gguf(tmp_path / "m.gguf", arch, random_weights(arch), uint32_keys={"general.sampling.top_k": 40},
                      float32_keys={"general.sampling.temp": 0.25, "general.sampling.top_p": 0.95,
                                    "general.sampling.penalty_repeat": 1.3})
    assert model_sampling_defaults(str(path)) == {"temperature": 0.25, "top_k": 40, "top_p": 0.95}
    assert model_sampling_defaults(str(tmp_path / "in-memory")) == {}


def test_unset_fields_take_the_model_s_values_and_set_ones_their_own() -> None:
    defaults = {"temperature": 0.6, "top_k": 20, "top_p": 0.8, "min_p": 0.05, "repetition_penalty": 1.1}
    unset = convert.sampling_params(pb.GenerateRequest(text="x"), None, defaults)
    assert (unset.temperature, unset.top_k, unset.top_p, unset.min_p, unset.repetition_penalty) == (
        0.6, 20, 0.8, 0.05, 1.1)
    chosen = convert.sampling_params(pb.GenerateRequest(text="x", sampling=pb.SamplingParameters(
        temperature=0, top_k=0, top_p=1, min_p=0, repetition_penalty=1)), None, defaults)
    assert (chosen.temperature, chosen.top_k, chosen.top_p, chosen.min_p, chosen.repetition_penalty) == (
        0, 0, 1, 0, 1)
    plain = convert.sampling_params(pb.GenerateRequest(text="x"))
    assert (plain.temperature, plain.top_k, plain.top_p, plain.min_p, plain.repetition_penalty) == (1, 0, 1, 0, 1)


@pytest.mark.parametrize("mode, expected", [("auto", {"temperature": 0.0}), ("forge", {})])
def test_the_engine_reads_them_unless_told_not_to(tmp_path: Path, mode: str, expected: dict) -> None:
    root = hf_model(tmp_path, {"temperature": 0.0})
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(root), dtype="float32", generation_config=mode)))
    assert engine.sampling_defaults == expected


def test_the_offline_api_samples_as_the_model_recommends_when_given_no_params(tmp_path: Path) -> None:
    from forge_service import LLM, SamplingParams

    root = hf_model(tmp_path, {"temperature": 0.0})
    llm = LLM(str(root), "float32", enable_prefix_caching=False)
    greedy = llm.generate(["hi there"], SamplingParams(temperature=0))[0].outputs[0].token_ids
    assert llm.generate(["hi there"])[0].outputs[0].token_ids == greedy  # the model says temperature 0
    assert llm.generate(["hi there"], SamplingParams(temperature=1.0, seed=3))[0].outputs[0].token_ids != greedy
    assert LLM(str(root), "float32", generation_config="forge").engine.sampling_defaults == {}


def test_generation_config_must_be_auto_or_forge() -> None:
    with pytest.raises(ValueError, match="generation_config must be 'auto' or 'forge', got 'vllm'"):
        ModelConfig(generation_config="vllm")
