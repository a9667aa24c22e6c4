"""GPU: the LoRA tests (tests/unit/test_lora.py) on the CUDA backend, on models whose head_dim (64)
the GPU's decode kernel takes: fp32 adapters against PEFT across prefill chunks, adapters and the
base model apart in the prefix cache, an unknown adapter refused, adapted greedy tokens through
preemption and speculation, and bf16 rows that answer the same whatever adapters share their step.

Each test is the CPU one, run with the engines it builds (its module's `LLM`) on the GPU."""
from __future__ import annotations

import pytest

from forge_service import LLM
from tests.kernels.helpers import engines_on
from tests.tiny_models import GPU_SIZES, tiny_arch, tiny_tokenizer_json, write_safetensors_dir
from tests.unit import test_lora as lora_tests

pytestmark = pytest.mark.gpu
on_the_gpu = engines_on("cuda", lora_tests)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("base_gpu")
    arch = tiny_arch(**GPU_SIZES)
    write_safetensors_dir(root, arch, lora_tests._weights(arch), tokenizer_json=tiny_tokenizer_json())
    return root


@pytest.fixture(scope="module")
def coded(tmp_path_factory) -> tuple[str, str]:
    return lora_tests.coded_model(tmp_path_factory.mktemp("coded_gpu"), tiny_arch(**GPU_SIZES))


test_fp32_adapter_equals_peft = lora_tests.test_fp32_adapter_equals_peft
test_the_prefix_cache_keeps_adapters_and_the_base_model_apart = \
    lora_tests.test_the_prefix_cache_keeps_adapters_and_the_base_model_apart
test_an_unknown_adapter_is_an_invalid_argument = lora_tests.test_an_unknown_adapter_is_an_invalid_argument
test_adapted_greedy_tokens_survive_preemption_and_speculation = \
    lora_tests.test_adapted_greedy_tokens_survive_preemption_and_speculation


def test_bf16_tokens_do_not_depend_on_the_adapters_beside_them(coded: tuple[str, str]) -> None:
    path, adapters_spec = coded
    llm = LLM(model=path, device="cuda", dtype="bfloat16", lora_modules=adapters_spec, enable_prefix_caching=False,
              max_num_batched_tokens=24)
    assert llm.engine.runner.device.type == "cuda"
    lora_tests.adapted_rows_stand_alone(llm)


def test_the_lora_tests_build_their_engines_on_the_gpu(coded: tuple[str, str]) -> None:
    assert lora_tests.LLM(model=coded[0], dtype="float32", lora_modules=coded[1]).engine.runner.device.type == "cuda"
