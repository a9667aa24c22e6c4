"""CI, no GPU: `--device` selection, and Forge importing without cuda-python or a GPU."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from forge_service.backends import create_backend
from forge_service.backends.cpu import CpuBackend
from forge_service.backends.cuda.decode_attention import MAX_PARTS, MIN_PART, grid_parts, split_parts
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


def test_decode_attention_cuts_a_row_by_its_own_length():
    for n in [0, 1, 255, 256, 257, 1000, 8192, 8193, 16384, 131072, 131073]:
        per_part, parts = split_parts(n)
        assert 1 <= parts <= MAX_PARTS and per_part >= MIN_PART
        assert (parts - 1) * per_part < max(n, 1) <= parts * per_part  # no empty part, none missing
    assert split_parts(200) == (MIN_PART, 1)  # short: one CTA per KV head, no reduction
    assert split_parts(131072) == (4096, MAX_PARTS)
    # The parts dimension sized for max_len holds every row up to it, whatever the batch.
    most = 0
    for n in range(0, 3 * MIN_PART * MAX_PARTS, 5):
        most = max(most, split_parts(n)[1])
        assert grid_parts(n) == max(most, 1)
