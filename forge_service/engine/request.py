"""Requests and their sampling parameters: plain Python, no torch."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from forge_service.errors import InvalidArgument
from forge_service.kv_cache.block_hash import ROOT

if TYPE_CHECKING:  # the structured package pulls in torch; requests stay plain Python
    import torch

    from forge_service.structured.constraint import Constraint


@dataclass
class SamplingParams:
    """Per-request sampling and stopping parameters (names follow vLLM's offline API)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # Words the output may not contain (at most MAX_BAD_WORDS): a step never completes one.
    bad_words: list[str] | None = None
    # The only tokens the output may have (EOS included only if listed); None: any.
    allowed_token_ids: list[int] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context length
    # The first min_tokens tokens are generated whatever comes: no stop token (EOS, stop_token_ids)
    # is sampled among them, and stop strings are looked for only in the text after them.
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # None: no logprobs. k >= 0: the chosen token's logprob plus the top-k alternatives.
    logprobs: int | None = None
    # None: no prompt logprobs. k >= 0: for every prompt token after the first, its logprob
    # given the tokens before it, plus the top-k alternatives there. The prompt is computed in
    # full (no prefix-cache hit), since a cached position has no logits.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Structured output: the text must match it (JSON Schema, any JSON object, regex, choice,
    # grammar). Compiled by the engine, not by validate(); with it, EOS ends the output exactly
    # when the text is complete, even with ignore_eos.
    constraint: Constraint | None = None
    # Speculative decoding: the most tokens to draft per step for this request; 0 turns it off,
    # None leaves the server's setting.
    num_speculative_tokens: int | None = None
    # A predicted output (token ids): text the output is expected to repeat for the most part,
    # which drafting proposes from first. It changes no output, only how fast it comes.
    prediction: list[int] | None = None
    # Scheduling rank under the "priority" policy: lower runs first (vLLM's convention); requests
    # of one priority run in arrival order. The "fcfs" policy takes 0 only.
    priority: int = 0
    # An embedding: the request computes its prompt and its one output token's completion carries
    # the final hidden state of the prompt's last token (after the model's final norm, fp32) in
    # CompletionOutput.embedding. It takes n 1 and max_tokens 1; the token itself is a by-product.
    embed: bool = False
    # The LoRA adapter to apply (a name the server loaded with --lora-modules); None: the base model.
    adapter: str | None = None

    MAX_LOGPROBS = 20
    MAX_BAD_WORDS = 64

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise InvalidArgument naming the first parameter out of range (its `field`: the
        attribute's name)."""
        checks = [
            (self.n >= 1, "n", f"n must be >= 1, got {self.n}"),
            (self.n <= 16, "n", f"n must be <= 16, got {self.n}"),
            (0.0 <= self.temperature <= 100.0, "temperature",
             f"temperature must be in [0, 100], got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, "top_k", f"top_k must be -1, 0 (disabled) or positive, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty",
             f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
             f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, "min_tokens", f"min_tokens must be >= 0, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"),
            (not (self.min_tokens and self.constraint is not None), "min_tokens",
             "min_tokens cannot be combined with structured output or tool calls: the grammar decides where the "
             "output ends"),
            (len(self.bad_words or []) <= self.MAX_BAD_WORDS, "bad_words",
             f"at most {self.MAX_BAD_WORDS} bad_words, got {len(self.bad_words or [])}"),
            (all(isinstance(w, str) and w.strip() and len(w) <= 256 for w in self.bad_words or []), "bad_words",
             "bad_words must be non-blank strings of at most 256 characters"),
            (not (self.bad_words and self.constraint is not None), "bad_words",
             "bad_words cannot be combined with structured output or tool calls: the grammar decides which tokens "
             "may come"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids",
             "allowed_token_ids must list at least one token"),
            (not (self.allowed_token_ids and self.bad_words), "allowed_token_ids",
             "allowed_token_ids cannot be combined with bad_words: leave the words' tokens out of the list"),
            (not (self.allowed_token_ids and self.constraint is not None), "allowed_token_ids",
             "allowed_token_ids cannot be combined with structured output or tool calls: the grammar decides which "
             "tokens may come"),
            (self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS, "logprobs",
             f"logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS, "prompt_logprobs",
             f"prompt_logprobs must be in [0, {self.MAX_LOGPROBS}], got {self.prompt_logprobs}"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings"),
            (len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}"),
            (self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= 64, "num_speculative_tokens",
             f"num_speculative_tokens must be in [0, 64], got {self.num_speculative_tokens}"),
            (not self.embed or (self.n == 1 and self.max_tokens == 1 and self.constraint is None), "embed",
             "an embedding takes n 1, max_tokens 1 and no structured output"),
        ]
        for ok, name, message in checks:
            if not ok:
                raise InvalidArgument(message, field=name)
        self._validate_token_ids(vocab_size)

    def _validate_token_ids(self, vocab_size: int | None) -> None:
        for token_id, bias in (self.logit_bias or {}).items():
            if vocab_size is not None and not 0 <= int(token_id) < vocab_size:
                raise InvalidArgument(f"logit_bias token id {token_id} is outside the vocabulary [0, {vocab_size})",
                                      field="logit_bias")
            if not -100.0 <= bias <= 100.0:
                raise InvalidArgument(f"logit_bias for token {token_id} must be in [-100, 100], got {bias}",
                                      field="logit_bias")
        for name in ("stop_token_ids", "allowed_token_ids"):
            bad = next((t for t in getattr(self, name) or [] if vocab_size is not None and not 0 <= t < vocab_size),
                       None)
            if bad is not None:
                raise InvalidArgument(f"{name} entry {bad} is outside the vocabulary [0, {vocab_size})", field=name)


@dataclass
class PromptLogprob:
    """A prompt token's logprob under the model given the tokens before it, its rank, and the
    top alternatives there (ids and logprobs, most likely first)."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class RequestTimes:
    """When things happened to one request (time.monotonic() seconds), for metrics and traces."""

    queued: float = field(default_factory=time.monotonic)  # the engine took it
    scheduled: float | None = None  # first scheduled (preemption does not reset it)
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed while computing it; the others went on

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED,
                        RequestStatus.FINISHED_ERROR)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass
class Request:
    """One sequence being generated. A prompt with n > 1 becomes n Requests sharing `parent_id`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Tokens that end generation (EOS ids unless ignore_eos, plus stop_token_ids).
    stop_token_set: frozenset[int] = frozenset()
    # sampling_params.bad_words as token sequences (forge_service/sampling/bad_words.py).
    bad_word_ids: tuple[tuple[int, ...], ...] = ()
    # sampling_params.allowed_token_ids, distinct, as a long tensor built once (None: any token).
    allowed_token_index: torch.Tensor | None = None
    # Hard cap on prompt + output tokens (the model's context length).
    max_model_len: int = 1 << 30
    parent_id: str | None = None
    index: int = 0  # which of the parent's n completions
    # The client's id for logs and traces (X-Request-Id, gRPC request_id): never a key, may repeat.
    label: str = ""
    seed: int | None = None  # this completion's seed (the parent's seed offset by index)
    adapter: int = 0  # the model's LoRA adapter for it (1-based index into LlamaModel.adapters); 0: none
    # Where its prefix-cache key chain starts: the root for the base model, one of the adapter's
    # own otherwise (an adapter's KV differs from the base model's for the same tokens).
    cache_root: bytes = ROOT
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # Prompt tokens whose KV came from the prefix cache at first admission.
    num_cached_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    # The token (id) or stop string that ended the request, when one did.
    stop_reason: int | str | None = None
    # (priority, arrival number): the scheduler's order, kept through preemption.
    queue_key: tuple[int, int] = (0, 0)
    times: RequestTimes = field(default_factory=RequestTimes)
    # Speculative decoding: tokens drafted for this request, and how many of them were accepted.
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0
    # With prompt_logprobs (the first of n completions only): prompt position -> what the runner
    # found there (see PromptLogprob), keyed so that a recomputed chunk overwrites, never adds.
    prompt_logprobs: dict[int, PromptLogprob] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def max_output_tokens(self) -> int:
        room = self.max_model_len - self.num_prompt_tokens
        cap = self.sampling_params.max_tokens
        return room if cap is None else min(cap, room)

    def check_stop(self) -> bool:
        """After appending a token: set a finished status if a token-level stop condition holds."""
        last = self.output_token_ids[-1]
        if last in self.stop_token_set:
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = last
        elif len(self.output_token_ids) >= self.max_output_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
        return self.status.finished
