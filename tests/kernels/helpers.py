"""Shared by the GPU kernel tests: dtype tolerances, NaN-poisoned device memory, comparisons, and
CPU engine tests run with their engines on the GPU."""
from __future__ import annotations

import functools
from types import ModuleType
from typing import Callable, Iterator

import pytest
import torch

from forge_service import LLM

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def poison_allocator() -> None:
    """Fill memory that torch's caching allocator will hand out next with NaN, so an output the
    kernel fails to write shows up as NaN instead of a stale, plausible value."""
    torch.cuda.synchronize()
    blocks = [torch.full((n,), float("nan"), device="cuda") for n in [1 << 8] * 64 + [1 << 18] * 16 + [1 << 24] * 4]
    del blocks
    torch.cuda.synchronize()


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    """No NaN, and within the dtype's tolerance (times `scale` for looser comparisons)."""
    assert not got.isnan().any(), "NaN in the output"
    tol = TOLERANCE[dtype] * scale
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=tol, rtol=tol)


def engines_on(device: str, *modules: ModuleType) -> Callable[[], Iterator[None]]:
    """A fixture for a module of GPU tests that reuses CPU engine tests (and their fixtures): while
    it runs, each of `modules` builds its engines (its `LLM`) on `device`. Autouse and
    module-scoped, it is set up before the module's other module-scoped fixtures, so the engines
    those build are on `device` too."""
    @pytest.fixture(autouse=True, scope="module")
    def on_device() -> Iterator[None]:
        with pytest.MonkeyPatch.context() as patch:
            for module in modules:
                patch.setattr(module, "LLM", functools.partial(LLM, device=device))
            yield
    return on_device
