"""The engine's live grammar matchers: one per constrained sequence, keyed by request id."""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from forge_service.structured.bitmask import allocate_token_bitmask
from forge_service.structured.compiler import CompiledGrammar, GrammarCompiler, GrammarMatcher

log = logging.getLogger(__name__)


class MatcherSet:
    """Per-sequence matchers for one engine; owned by the engine thread.

    Each step the model runner asks for the packed bitmask of the rows that sample (None when
    none is constrained, so unconstrained batches pay nothing), samples, then hands over the
    tokens with `accept`. A matcher lives from add_request until the request is released, so
    preemption (recompute keeps the generated tokens and never samples them again) leaves it
    exactly where it was.
    """

    def __init__(self, compiler: GrammarCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, GrammarMatcher] = {}

    def add(self, request_id: str, grammar: CompiledGrammar) -> None:
        assert request_id not in self._matchers, request_id
        self._matchers[request_id] = GrammarMatcher(grammar)

    def release(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def get(self, request_id: str) -> GrammarMatcher | None:
        return self._matchers.get(request_id)

    def __len__(self) -> int:
        return len(self._matchers)

    def bitmask(self, request_ids: Sequence[str], ahead: Sequence[Sequence[int]] | None = None) -> torch.Tensor | None:
        """int32 [N, ceil(V / 32)] for the N rows that sample, rows without a matcher all-allowed;
        None when no row has a matcher. `ahead[i]`: draft tokens that row i's position follows
        (speculative decoding); its mask is the matcher's after them, and the matcher is left
        where it was."""
        if not self._matchers:
            return None
        rows = [(i, m) for i, rid in enumerate(request_ids) if (m := self._matchers.get(rid)) is not None]
        if not rows:
            return None
        bitmask = allocate_token_bitmask(len(request_ids), self.compiler.vocab_size)
        now = [(i, m) for i, m in rows if not (ahead and ahead[i])]
        self.compiler.fill_bitmasks([m for _, m in now], bitmask, [i for i, _ in now])
        for i, m in rows:
            if ahead and ahead[i]:
                self._fill_after(m, ahead[i], bitmask, i)
        return bitmask

    def _fill_after(self, m: GrammarMatcher, tokens: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        accepted = m.accept_prefix(tokens)
        try:
            if accepted < len(tokens):  # drafts are cut at their first refused token before this
                raise RuntimeError(f"draft token {tokens[accepted]} is outside the grammar")
            self.compiler.fill_bitmasks([m], bitmask, [row])
        finally:
            m.rollback(accepted)

    def accept(self, request_ids: Sequence[str], token_ids: Sequence[int]) -> set[str]:
        """Advance each constrained row by its sampled token; returns the ids whose token the
        grammar refused (the mask makes that a bug, never a silently unconstrained output)."""
        refused = set()
        for rid, token in zip(request_ids, token_ids):
            m = self._matchers.get(rid)
            if m is not None and not m.accept_token(token):
                log.error("request %s: sampled token %d is outside its grammar (%s)", rid, token,
                          m.grammar.constraint.kind)
                refused.add(rid)
        return refused
