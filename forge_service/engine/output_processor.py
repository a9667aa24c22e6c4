"""Per-completion output processing: incremental detokenization, stop strings, logprobs."""
from __future__ import annotations

from forge_service.engine.output_types import CompletionOutput, Logprob
from forge_service.engine.request import Request, RequestStatus
from forge_service.runner.model_runner import SampledToken
from forge_service.structured.compiler import CompiledGrammar
from forge_service.tokenizer import IncrementalDetokenizer, StopStringMatcher, Tokenizer


class TokenTexts:
    """Decoded text and exact bytes of single tokens (for logprobs), cached per id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        entry = self.cache.get(token_id)
        if entry is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            entry = self.cache[token_id] = (text, self.tokenizer.token_bytes(token_id))
        return entry

    def entries(self, token_id: int, logprob: float, rank: int | None,
                top: list[tuple[int, float]] | None) -> list[Logprob]:
        """One position's logprobs: the chosen token, then the top alternatives (ranks 1, 2, ...)."""
        chosen = Logprob(token_id, logprob, rank, *self(token_id))
        return [chosen, *(Logprob(t, lp, r + 1, *self(t)) for r, (t, lp) in enumerate(top or []))]

    def prompt(self, request: Request) -> list[list[Logprob] | None]:
        """The request's prompt logprobs as returned: None for the first token (nothing comes
        before it), then one entry per prompt token. Every position must have been computed."""
        found = request.prompt_logprobs or {}
        missing = [p for p in range(1, request.num_prompt_tokens) if p not in found]
        if missing:
            raise RuntimeError(f"prompt logprobs of {len(missing)} positions were not computed (first: {missing[0]})")
        rows = (found[p] for p in range(1, request.num_prompt_tokens))
        return [None, *(self.entries(r.token_id, r.logprob, r.rank, r.top) for r in rows)]


class CompletionProcessor:
    """Turns one request's sampled tokens into text deltas; reports a matched stop string."""

    def __init__(self, tokenizer: Tokenizer, request: Request, token_texts: TokenTexts,
                 grammar: CompiledGrammar | None = None) -> None:
        """`grammar`: the request's structured output. A stop string then ends the output only where
        the text before it (with it, under include_stop_str_in_output) is complete for the grammar;
        elsewhere it is ordinary text, so an output that finishes with `stop` always parses."""
        params = request.sampling_params
        self.detok = IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.skip_special_tokens)
        can_end = grammar.accepts if grammar is not None else None
        self.stops = StopStringMatcher(params.stop, params.include_stop_str_in_output, can_end) \
            if params.stop else None
        self.min_tokens = params.min_tokens
        self.token_texts = token_texts
        self.want_logprobs = params.logprobs is not None
        self.cumulative_logprob = 0.0 if self.want_logprobs else None

    def process(self, request: Request, sampled: SampledToken) -> tuple[CompletionOutput, str | None]:
        """Delta output for one new token, and the stop string it completed (if any)."""
        delta = CompletionOutput(index=request.index, token_ids=[sampled.token_id], embedding=sampled.embedding)
        if self.want_logprobs:
            delta.logprobs = [self._logprobs(sampled)]
            self.cumulative_logprob += sampled.logprob
            delta.cumulative_logprob = self.cumulative_logprob
        stopped_by_token = request.status == RequestStatus.FINISHED_STOPPED and request.stop_reason == sampled.token_id
        text = "" if stopped_by_token and not request.sampling_params.include_stop_str_in_output \
            else self.detok.add([sampled.token_id])
        matched = None
        if self.stops is not None and len(request.output_token_ids) > self.min_tokens:
            text, matched = self.stops.feed(text)
        if request.status.finished and matched is None:
            text += self._flush()
        delta.text = text
        return delta, matched

    def _flush(self) -> str:
        tail = self.detok.flush()
        if self.stops is None:
            return tail
        text, _ = self.stops.feed(tail)
        return text + self.stops.flush()

    def _logprobs(self, s: SampledToken) -> list[Logprob]:
        return self.token_texts.entries(s.token_id, s.logprob, s.rank, s.top)
