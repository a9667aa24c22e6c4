"""GPU: LoRA adapters are served on the CPU backend only; on the CUDA backend they are refused when
the engine loads, with an error that says so (not taken silently, or failed on a first request)."""
from __future__ import annotations

import pytest

from forge_service import LLM
from tests.tiny_models import GPU_SIZES, tiny_arch
from tests.unit import test_lora as lora_tests

pytestmark = pytest.mark.gpu


def test_lora_adapters_are_refused_on_the_gpu(tmp_path_factory) -> None:
    path, adapters = lora_tests.coded_model(tmp_path_factory.mktemp("coded_gpu"), tiny_arch(**GPU_SIZES))
    with pytest.raises(ValueError, match="served on the CPU backend only"):
        LLM(model=path, device="cuda", dtype="bfloat16", lora_modules=adapters)
