"""Whether the CUDA backend can run here (tests marked `gpu` are skipped where it cannot)."""
from __future__ import annotations

import importlib.util


def gpu_unavailable_reason() -> str | None:
    """Why the CUDA backend cannot run here, or None when it can."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU visible to torch"
    if importlib.util.find_spec("cuda") is None:
        return "cuda-python is not installed (pip install '.[cuda]')"
    return None
