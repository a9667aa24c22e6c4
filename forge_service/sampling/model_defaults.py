"""The sampling settings a model's files recommend, used for what a request leaves unset.

A Hugging Face directory's generation_config.json may set temperature, top_p, top_k, min_p and
repetition_penalty (the model's authors' choice, e.g. a temperature of 0.6 for a reasoning model);
a GGUF file may carry general.sampling.temp, .top_p, .top_k and .min_p. With --generation-config
auto (the default), a request that leaves one of these unset gets the model's value, as
transformers' generate() and vLLM's server do; `forge` keeps Forge's own defaults (temperature 1,
everything else off). GGUF's general.sampling.penalty_repeat is not taken: it penalises only the
last penalty_last_n tokens, which is not what repetition_penalty means here."""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from forge_service.engine.request import SamplingParams
from forge_service.errors import InvalidArgument
from forge_service.loaders.gguf_file import read_gguf
from forge_service.loaders.safetensors import read_json

log = logging.getLogger(__name__)

# The fields a model may set, as generation_config.json names them (SamplingParams' names too).
FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
_GGUF_KEYS = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
              "general.sampling.top_k": "top_k", "general.sampling.min_p": "min_p"}


def model_sampling_defaults(path: str) -> dict[str, float | int]:
    """The sampling defaults that the model at `path` (a .gguf file or a Hugging Face directory)
    sets; {} when it sets none. A value of the wrong type or out of range is left out, with a
    warning (the model still serves). A path that is neither (a model built in memory) sets none."""
    if os.path.isdir(path):
        found = {k: v for k, v in read_json(Path(path, "generation_config.json"), required=False).items() if k in FIELDS}
    elif os.path.isfile(path) and path.endswith(".gguf"):
        fields = read_gguf(path).fields
        found = {name: fields[key].contents() for key, name in _GGUF_KEYS.items() if key in fields}
        # float32 in the file: 0.95 reads as 0.949999988; its shortest decimal is what was written
        found = {name: float(f"{v:.7g}") if isinstance(v, float) else v for name, v in found.items()}
    else:
        return {}
    return {name: value for name, value in found.items() if _usable(path, name, value)}


def _usable(path: str, name: str, value: Any) -> bool:
    kind = int if name == "top_k" else float
    problem = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        problem = f"not a{'n integer' if kind is int else ' number'}"
    else:
        try:
            SamplingParams(**{name: kind(value)}).validate()
        except InvalidArgument as error:
            problem = str(error)
    if problem:
        log.warning("%s: the model's default %s=%r is not used: %s", path, name, value, problem)
    return problem is None

