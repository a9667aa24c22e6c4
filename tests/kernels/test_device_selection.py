"""CI, no GPU: `--device` selection, and Forge importing without cuda-python or a GPU."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from forge_service.backends import create_backend
from forge_service.backends.cpu import CpuBackend
from forge_service.backends.cuda.decode_attention import plan_splits
from forge_service.errors import DeviceUnavailable, InvalidArgument
from tests.gpu import gpu_unavailable_reason


def test_cpu_is_the_reference_backend():
    assert isinstance(create_backend("cpu"), CpuBackend)


def test_an_unknown_device_is_a_clear_error():
    with pytest.raises(InvalidArgument, match="cpu, cuda.*'tpu'"):
        create_backend("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_says_why():
    with pytest.raises(DeviceUnavailable, match="no CUDA GPU|cuda-python"):
        create_backend("cuda")
    assert gpu_unavailable_reason() is not None


def test_forge_imports_without_cuda_python():
    """With `cuda` unimportable, the engine and the CUDA package import; only choosing cuda fails."""
    code = (
        "import sys; sys.modules['cuda'] = None\n"
        "import forge_service.engine.engine, forge_service.llm, forge_service.server\n"
        "import forge_service.backends.cuda.kernels, forge_service.backends.cuda.backend\n"
        "from forge_service.backends import create_backend\n"
        "from forge_service.errors import DeviceUnavailable\n"
        "try:\n    create_backend('cuda')\nexcept DeviceUnavailable as e:\n    print('refused:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "refused:" in result.stdout and "cuda-python" in result.stdout


def test_generate_with_device_cuda_fails_cleanly_without_a_gpu():
    if gpu_unavailable_reason() is None:
        pytest.skip("a usable GPU is present")
    result = subprocess.run([sys.executable, "-m", "forge_service.cli", "generate", "--prompt", "hi",
                             "--device", "cuda"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error:") and "cuda" in result.stderr.lower()


def test_split_plan_fills_the_gpu_only_when_needed():
    assert plan_splits(256, 8, 4096, 132) == 1  # 2048 CTAs already
    one = plan_splits(1, 8, 131072, 132)
    assert 8 * one >= 132 and one == 32  # batch 1: as many splits as allowed
    assert plan_splits(1, 8, 16, 132) == 1  # too short to split
