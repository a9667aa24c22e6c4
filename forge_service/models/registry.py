"""Model registry: architecture name -> model class."""
from __future__ import annotations

from typing import Callable

import torch

from forge_service.backends.base import QuantCodes
from forge_service.errors import ModelLoadError
from forge_service.models.arch import VARIANTS, ArchConfig
from forge_service.models.llama import LlamaModel

MODELS = {key: LlamaModel for key in VARIANTS}  # each a Llama decoder; its ArchConfig flags say how it differs


def build_model(path: str, arch: ArchConfig, weights: dict[str, torch.Tensor], backend,
                codes: dict[str, QuantCodes] | None = None,
                decoders: dict[str, Callable[[], torch.Tensor]] | None = None):
    """`decoders`: the dense form of each weight that `weights` holds as a meta tensor (see
    Checkpoint.decoders), for the layers whose backend needs it."""
    if arch.architecture not in MODELS:
        raise ModelLoadError(path, f"unsupported architecture {arch.architecture!r}; supported: {sorted(MODELS)}")
    return MODELS[arch.architecture](arch, weights, backend, codes, decoders)
