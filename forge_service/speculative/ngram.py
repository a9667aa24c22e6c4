"""Prompt-lookup n-gram drafting with an incremental per-request index.

Plain Python over token ids (no torch). Each request keeps, for every n in
[min_n, max_n], a dict from the n-gram ending at position i to the latest such
i that has a following token. Appending a token costs O(max_n - min_n + 1) dict
updates; proposing costs at most the same number of look-ups plus k list reads.
"""

from __future__ import annotations

import math

from collections.abc import Iterable


class NgramIndex:
    """Incremental n-gram index over one request's prompt + output tokens."""

    __slots__ = ("min_n", "max_n", "tokens", "_maps")

    def __init__(self, min_n: int = 2, max_n: int = 4, tokens: Iterable[int] = ()) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []
        # _maps[n - min_n][ngram] = end index (exclusive) of the latest occurrence
        # of `ngram` that is followed by at least one token.
        self._maps: list[dict[tuple[int, ...], int]] = [{} for _ in range(min_n, max_n + 1)]
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        toks = self.tokens
        end = len(toks)  # the n-grams ending here now gain a following token
        for n in range(self.min_n, self.max_n + 1):
            if end >= n:
                self._maps[n - self.min_n][tuple(toks[end - n:end])] = end
        toks.append(int(token))

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest earlier match of the current suffix."""
        toks = self.tokens
        size = len(toks)
        if k <= 0:
            return []
        for n in range(self.max_n, self.min_n - 1, -1):
            if size < n:
                continue
            end = self._maps[n - self.min_n].get(tuple(toks[size - n:]))
            if end is not None:
                return toks[end:min(end + k, size)]
        return []


class AdaptiveDraftLength:
    """Per-request draft length from an estimate of how likely its next drafted token is accepted.

    `rate` is that probability, estimated from recent verifications with decay (each accepted
    position a success, the first rejected one a failure; a prior of one of each). A draft of
    length k gets position j verified at the cost of one more row in the step, and the token is
    kept with probability rate ** j, so the draft is as long as that stays at or above the
    step's `worth` (what a row must yield to pay for itself; the scheduler's cost model). At
    length 0 a one-token probe is made every `probe_interval / (1 - worth)` steps, so that text
    that turns repetitive later still gains.

    A draft accepted whole says that the request is copying, and copying goes on: the draft after
    one is estimated apart, with its own decayed counts and a prior of RUN_PRIOR (4.5 accepted to
    0.5 cut: 0.9, worth five verifications), until a draft is cut short. One stream then drafts
    the longest at once, where a rate learned over the whole request would grow step by step,
    while at many streams, where a row must be kept with probability ~0.9 to pay, such a draft
    stays short.
    """

    RUN_PRIOR = (4.5, 0.5)

    __slots__ = ("max_k", "decay", "probe_interval", "_accepted", "_rejected", "_idle", "_run", "_run_accepted",
                 "_run_rejected")

    def __init__(self, max_k: int = 8, *, decay: float = 0.8, probe_interval: int = 16) -> None:
        if max_k < 0:
            raise ValueError("max_k must be >= 0")
        self.max_k = max_k
        self.decay = decay
        self.probe_interval = probe_interval
        self._accepted = self._rejected = 0.0
        self._idle = 0
        self._run = False  # the last verified draft was accepted whole
        self._run_accepted = self._run_rejected = 0.0

    @property
    def rate(self) -> float:
        if self._run:
            accepted, rejected = self.RUN_PRIOR
            return (self._run_accepted + accepted) / (self._run_accepted + self._run_rejected + accepted + rejected)
        return (self._accepted + 1.0) / (self._accepted + self._rejected + 2.0)

    def draft_len(self, worth: float = 0.0) -> int:
        """How many tokens to draft this step (0 = none), where a verified position must be kept
        with probability `worth` (in [0, 1)) to pay for its row."""
        rate, k = self.rate, self.max_k
        if worth > 0.0:
            k = min(k, int(math.log(worth) / math.log(rate)) if rate < 1.0 else k)
        if k > 0 or self.max_k == 0:
            self._idle = 0
            return k
        # A probe costs a row too: the dearer rows are (the higher `worth`), the rarer the probes.
        self._idle += 1
        if self._idle >= self.probe_interval / max(1.0 - worth, 1e-3):
            self._idle = 0
            return 1
        return 0

    def update(self, proposed: int, accepted: int) -> None:
        if proposed <= 0:
            return
        cut = 1 if accepted < proposed else 0
        if self._run:  # the counts of the estimate this draft's length came from
            self._run_accepted = self.decay * self._run_accepted + accepted
            self._run_rejected = self.decay * self._run_rejected + cut
        else:
            self._accepted = self.decay * self._accepted + accepted
            self._rejected = self.decay * self._rejected + cut
        self._run = not cut
