"""Backends: cpu.py (torch, the reference) and cuda/ (NVRTC kernels); chosen by --device."""
from __future__ import annotations

from typing import Any

from forge_service.backends.cpu import BACKENDS
from forge_service.errors import InvalidArgument


def create_backend(device: str) -> Any:
    """The backend for `device`; raises InvalidArgument for an unknown name and DeviceUnavailable
    when the device cannot be used here."""
    if device not in BACKENDS:
        raise InvalidArgument(f"device must be one of {', '.join(sorted(BACKENDS))}; got {device!r}")
    return BACKENDS[device]()
