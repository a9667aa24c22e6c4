"""Structured output: constraints (JSON Schema, JSON object, regex, choice, grammar) -> per-step token bitmasks.

The engine codes against GrammarCompiler / CompiledGrammar / GrammarMatcher; the grammar
library behind them is a registered backend (backend.py; llguidance by default, chosen by
bench/structured_backends.py). Masks are packed int32 bitmasks (bitmask.py).

Names load on first use: the servicer needs only `Constraint` (plain data) before the model
loads, and must bind its port without importing torch first.
"""
from __future__ import annotations

import importlib
from typing import Any

# name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(["BACKENDS", "DEFAULT_BACKEND", "BackendGrammar", "BackendMatcher", "GrammarBackend"], "backend"),
    **dict.fromkeys(["allocate_token_bitmask", "apply_token_bitmask_", "bitmask_words", "pack_bitmask",
                     "unpack_bitmask"], "bitmask"),
    **dict.fromkeys(["CompiledGrammar", "GrammarCompiler", "GrammarMatcher"], "compiler"),
    **dict.fromkeys(["KINDS", "Constraint"], "constraint"),
    "MatcherSet": "matchers",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
