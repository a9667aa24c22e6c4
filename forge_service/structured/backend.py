"""The grammar-backend interface and the registry of backends.

A backend turns a Constraint into a grammar for one tokenizer and runs per-sequence matchers
over it. `GrammarCompiler` (compiler.py) adds caching, the compile thread pool and EOS
bookkeeping on top, so a backend stays a thin wrapper over its library. To add one, write a
class with this shape and register a factory in BACKENDS (imports stay lazy, so a backend's
library is only needed when it is chosen).
"""
from __future__ import annotations

import importlib
from typing import Callable, Protocol, Sequence

import torch
from tokenizers import Tokenizer

from forge_service.structured.constraint import Constraint


class BackendMatcher(Protocol):
    """One sequence's position in a grammar. Never enters a state it cannot leave on a bad token.

    It never sees EOS tokens (GrammarMatcher accepts EOS when `is_accepting`), but its mask
    sets the EOS bits exactly when `is_accepting` is true.
    """

    def accept_token(self, token_id: int) -> bool: ...  # False, state unchanged, when the grammar forbids it

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None: ...  # bitmask: [N, W] int32, CPU

    def is_accepting(self) -> bool: ...  # the text so far is a complete match

    def rollback(self, num_tokens: int) -> None: ...  # callers never roll back past the start

    def reset(self) -> None: ...


class BackendGrammar(Protocol):
    """A compiled, immutable grammar; shared by every matcher over it, from any thread."""

    def matcher(self) -> BackendMatcher: ...

    def accepts_text(self, text: str) -> bool: ...  # `text` is a complete match (e.g. parses as the schema)


class GrammarBackend(Protocol):
    """One per tokenizer. `compile` raises InvalidArgument(reason) for what it cannot honour."""

    name: str

    def compile(self, constraint: Constraint) -> BackendGrammar: ...

    def fill_bitmasks(self, matchers: Sequence[BackendMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None: ...


BackendFactory = Callable[[Tokenizer, int, Sequence[int]], GrammarBackend]


def _lazy(module: str, cls: str) -> BackendFactory:
    def factory(tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarBackend:
        return getattr(importlib.import_module(module), cls)(tokenizer, vocab_size, eos_token_ids)

    return factory


# name -> factory(tokenizer, vocab_size, eos_token_ids)
BACKENDS: dict[str, BackendFactory] = {
    "llguidance": _lazy("forge_service.structured.llguidance_backend", "LLGuidanceBackend"),
}
DEFAULT_BACKEND = "llguidance"


def create_backend(name: str, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarBackend:
    if name not in BACKENDS:  # a deployment setting, checked at start-up
        raise ValueError(f"unknown structured output backend {name!r}; expected one of {sorted(BACKENDS)}")
    return BACKENDS[name](tokenizer, vocab_size, eos_token_ids)
