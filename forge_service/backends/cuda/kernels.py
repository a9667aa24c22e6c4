"""The typed kernel wrappers, one module per native/*.cu, and the programs CI compiles."""
from __future__ import annotations

from types import ModuleType

from forge_service.backends.cuda import (activation, cache, decode_attention, norm, prefill_attention, rotary,
                                         sampling)
from forge_service.backends.cuda.nvrtc import Program

WRAPPERS: tuple[ModuleType, ...] = (norm, activation, rotary, cache, decode_attention, prefill_attention, sampling)


def ci_programs(arch: str) -> list[Program]:
    """One program per native source with the instantiations the models here use."""
    return [Program(w.SOURCE, arch, w.ci_names()) for w in WRAPPERS]
