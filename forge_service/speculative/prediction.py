"""Drafting from a predicted output (OpenAI's `prediction`): text the answer is expected to repeat
for the most part, such as a file being edited.

Plain Python over token ids, as the n-gram index. While the output so far is the prediction's
start, the draft is the prediction's next tokens. Once they part (an edit), the output's last n
tokens (n from max_n down to min_n, prompt tokens included) are looked up in the prediction; of
their occurrences the first at or after where the last accepted run ended is taken (an edit keeps
the order of the text it edits), else the last one before it.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence


class PredictionDraft:
    """Where one request's output stands in its predicted output, and what comes next there."""

    __slots__ = ("tokens", "min_n", "max_n", "_ends", "_matched", "_checked", "_prefix", "_cursor", "_last_end")

    def __init__(self, prediction: Sequence[int], min_n: int = 2, max_n: int = 4) -> None:
        if min_n < 1 or max_n < min_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.tokens = list(prediction)
        self.min_n, self.max_n = min_n, max_n
        # _ends[n - min_n][ngram]: the ends (exclusive, ascending) of its occurrences that a token
        # follows; built when the output first leaves the prediction's start (~2 ms per 1,000 tokens).
        self._ends: list[dict[tuple[int, ...], list[int]]] | None = None
        self._matched = 0  # output tokens equal to the prediction's start, while _prefix
        self._checked = 0  # output tokens compared so far
        self._prefix = True
        self._cursor = 0  # where the last accepted run ended in the prediction
        self._last_end: int | None = None  # where the last draft started, when this made it

    def propose(self, output: Sequence[int], context: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens of the prediction to follow `output` (the tokens generated so far;
        `context`: the prompt and `output`, whose end is matched once the output has left the
        prediction's start)."""
        self._last_end = None
        if k <= 0:
            return []
        self._follow(output)
        if self._prefix:
            end = self._matched
        else:
            end = self._find(context)
            if end is None:
                return []
        self._last_end = end
        return self.tokens[end:end + k]

    def accepted(self, count: int) -> None:
        """`count` tokens of the last draft were accepted."""
        if self._last_end is not None:
            self._cursor = self._last_end + count
            self._last_end = None

    def _follow(self, output: Sequence[int]) -> None:
        tokens = self.tokens
        while self._prefix and self._checked < len(output):
            if self._matched < len(tokens) and output[self._checked] == tokens[self._matched]:
                self._matched += 1
            else:
                self._prefix = False
            self._checked += 1

    def _find(self, context: Sequence[int]) -> int | None:
        if self._ends is None:
            self._ends = [{} for _ in range(self.min_n, self.max_n + 1)]
            for n, by_ngram in enumerate(self._ends, self.min_n):
                for end in range(n, len(self.tokens)):
                    by_ngram.setdefault(tuple(self.tokens[end - n:end]), []).append(end)
        size = len(context)
        for n in range(self.max_n, self.min_n - 1, -1):
            if size < n:
                continue
            ends = self._ends[n - self.min_n].get(tuple(context[size - n:]))
            if ends:
                at = bisect.bisect_left(ends, self._cursor)
                return ends[at] if at < len(ends) else ends[-1]
        return None
