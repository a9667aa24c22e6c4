"""Suite-wide: tests marked `gpu` are skipped, not failed, where no CUDA GPU can be used."""
from __future__ import annotations

import pytest

from tests.gpu import gpu_unavailable_reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if "gpu" in item.keywords]
    reason = gpu_unavailable_reason() if gpu_items else None
    if reason is not None:
        for item in gpu_items:
            item.add_marker(pytest.mark.skip(reason=f"gpu test: {reason}"))
