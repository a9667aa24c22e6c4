"""Each backend implements the whole Backend protocol itself, with the protocol's signatures: no
backend inherits another's code paths, and none lacks a method the model or the runner calls."""
from __future__ import annotations

import inspect

import pytest
import torch

from forge_service import backends
from forge_service.backends.base import Backend
from forge_service.backends.cpu import CpuBackend
from forge_service.backends.cuda.backend import CudaBackend  # imports without cuda-python or a GPU

METHODS = sorted(name for name, value in vars(Backend).items() if inspect.isfunction(value) and name[0] != "_")
ATTRIBUTES = sorted(Backend.__annotations__)


def _parameters(function) -> list[str]:
    return [p for p in inspect.signature(function).parameters if p != "self"]


def test_the_protocol_lists_what_the_model_and_runner_call() -> None:
    assert METHODS == sorted([
        "pack_linear", "needs_dense", "linear", "linear_widened", "rms_norm", "add_rms_norm", "final_norm",
        "head_rms_norm", "lora_add", "refine_leaders", "silu_and_mul", "rotary_tables", "rotary", "write_kv",
        "attention", "decode_plan", "prepare", "sampler", "startup", "run"])
    assert ATTRIBUTES == ["device", "name"]
    for name in METHODS:
        assert inspect.getdoc(getattr(Backend, name)), f"Backend.{name} has no docstring"


@pytest.mark.parametrize("cls", [CpuBackend, CudaBackend])
def test_backend_defines_every_protocol_method_itself(cls: type) -> None:
    own = vars(cls)
    missing = [name for name in METHODS if name not in own]
    assert missing == [], f"{cls.__name__} does not define {missing}"
    for name in METHODS:
        function = inspect.getattr_static(cls, name)
        function = function.__func__ if isinstance(function, (staticmethod, classmethod)) else function
        assert _parameters(function) == _parameters(getattr(Backend, name)), f"{cls.__name__}.{name}"


def test_cuda_backend_shares_no_class_with_the_cpu_backend() -> None:
    assert CudaBackend.__mro__ == (CudaBackend, object)
    assert CpuBackend.__mro__ == (CpuBackend, object)


def test_the_registry_builds_the_cpu_backend_and_it_fits_the_protocol() -> None:
    backend = backends.create_backend("cpu")
    assert isinstance(backend, CpuBackend)
    assert backend.name == "cpu" and backend.device == torch.device("cpu")
    assert sorted(backends.BACKENDS) == ["cpu", "cuda"]
