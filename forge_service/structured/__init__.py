"""Structured output: constraints (JSON Schema, JSON object, regex, choice, grammar) -> per-step token bitmasks.

The engine codes against GrammarCompiler / CompiledGrammar / GrammarMatcher; the grammar
library behind them is a registered backend (backend.py; llguidance by default, chosen by
bench/structured_backends.py). Masks are packed int32 bitmasks (bitmask.py).
"""
from forge_service.structured.backend import BACKENDS, DEFAULT_BACKEND, BackendGrammar, BackendMatcher, GrammarBackend
from forge_service.structured.bitmask import (allocate_token_bitmask, apply_token_bitmask_, bitmask_words,
                                              pack_bitmask, unpack_bitmask)
from forge_service.structured.compiler import CompiledGrammar, GrammarCompiler, GrammarMatcher
from forge_service.structured.constraint import KINDS, Constraint

__all__ = [
    "BACKENDS", "DEFAULT_BACKEND", "BackendGrammar", "BackendMatcher", "GrammarBackend",
    "allocate_token_bitmask", "apply_token_bitmask_", "bitmask_words", "pack_bitmask", "unpack_bitmask",
    "CompiledGrammar", "GrammarCompiler", "GrammarMatcher", "KINDS", "Constraint",
]
