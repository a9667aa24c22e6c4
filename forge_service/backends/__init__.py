"""Backends, chosen by --device: base.py (the Backend protocol every backend implements),
cpu.py (torch and native CPU kernels, the reference) and cuda/ (NVRTC kernels), side by side.

The registry imports a backend only when it is chosen: Forge imports without cuda-python or a GPU,
and importing base.py (what layers and models use) loads no backend.
"""
from __future__ import annotations

import importlib
from typing import Callable

from forge_service.backends.base import Backend
from forge_service.errors import InvalidArgument


def _lazy(module: str, cls: str) -> Callable[[], Backend]:
    def create() -> Backend:
        return getattr(importlib.import_module(module), cls)()

    return create


# --device name -> the backend's constructor (a class, or a function importing it on first use)
BACKENDS: dict[str, Callable[[], Backend]] = {
    "cpu": _lazy("forge_service.backends.cpu", "CpuBackend"),
    "cuda": _lazy("forge_service.backends.cuda.backend", "CudaBackend"),
}


def create_backend(device: str) -> Backend:
    """The backend for `device`; raises InvalidArgument for an unknown name and DeviceUnavailable
    when the device cannot be used here."""
    if device not in BACKENDS:
        raise InvalidArgument(f"device must be one of {', '.join(sorted(BACKENDS))}; got {device!r}")
    return BACKENDS[device]()
