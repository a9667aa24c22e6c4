"""Fixtures of the GPU kernel tests: one CudaBackend for the session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cuda_backend():
    from forge_service.backends.cuda.backend import CudaBackend

    return CudaBackend()


@pytest.fixture(scope="session")
def kernels(cuda_backend):
    return cuda_backend.kernels
