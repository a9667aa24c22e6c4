"""What the engine returns: per request, one entry per completion (vLLM's offline names)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forge_service.engine.request import RequestTimes


@dataclass
class Logprob:
    token_id: int
    logprob: float
    rank: int | None
    token: str  # the token's text on its own
    bytes: bytes | None = None  # its exact bytes (part of a character when `token` shows U+FFFD)


@dataclass
class CompletionOutput:
    """One completion. In LLMEngine.step() results it holds the delta since the last step;
    in LLM.generate() results, everything."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # Per generated token: [chosen, *top alternatives]; None when logprobs were not asked for.
    logprobs: list[list[Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # On a completion's last delta: when it was queued, scheduled, got its first token, finished.
    times: RequestTimes | None = None
    # Speculative decoding so far (cumulative, not a delta): tokens drafted and accepted.
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # SamplingParams.embed: the prompt's last hidden state (on the delta of its one token).
    embedding: list[float] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def extend(self, later: CompletionOutput) -> None:
        """Fold `later`, this completion's next delta, into this one."""
        self.text += later.text
        self.token_ids += later.token_ids
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
            self.cumulative_logprob = later.cumulative_logprob
        if later.finish_reason is not None:
            self.finish_reason, self.stop_reason = later.finish_reason, later.stop_reason
        self.times = later.times or self.times
        self.num_drafted_tokens = max(self.num_drafted_tokens, later.num_drafted_tokens)
        self.num_accepted_tokens = max(self.num_accepted_tokens, later.num_accepted_tokens)
        self.embedding = later.embedding or self.embedding


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt: str | None = None
    num_cached_tokens: int = 0
    # With prompt_logprobs: None for the prompt's first token, then [chosen, *top alternatives]
    # per prompt token; on the request's first delta only.
    prompt_logprobs: list[list[Logprob] | None] | None = None
    # Set when the engine failed while computing this request (finish_reason "error"): a message
    # for the client with an error id that is also in the log. The other requests went on.
    error: str | None = None

    def extend(self, later: RequestOutput) -> None:
        """Fold `later`, this request's next delta, into this one: each completion's tokens in order."""
        self.finished = self.finished or later.finished
        self.num_cached_tokens = max(self.num_cached_tokens, later.num_cached_tokens)
        self.error = later.error or self.error
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        mine = {o.index: o for o in self.outputs}
        for delta in later.outputs:
            if delta.index in mine:
                mine[delta.index].extend(delta)
            else:
                self.outputs.append(delta)
                mine[delta.index] = delta

    @property
    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": len(self.prompt_token_ids),
            "completion_tokens": sum(len(o.token_ids) for o in self.outputs),
            "cached_tokens": self.num_cached_tokens,
        }
