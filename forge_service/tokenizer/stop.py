"""Stop strings on a stream of text deltas, without ever emitting text that must later be taken back."""
from __future__ import annotations

from typing import Callable


class StopStringMatcher:
    """Feeds text deltas through; holds back any tail that could still grow into a stop string.

    On a match, the emitted text ends right before the stop string (or right after it with
    `include_stop_str_in_output`) and the matcher is done: later feeds return nothing.
    Among stops matching in the same step the earliest start wins, then the longest.

    `can_end(text)`, when given, says whether the whole output may end as `text` (structured
    output: only where the grammar is complete). A match whose output could not end there is not
    a stop: its text is emitted like any other and matching goes on after it.
    """

    def __init__(self, stops: list[str], include_stop_str_in_output: bool = False,
                 can_end: Callable[[str], bool] | None = None) -> None:
        self.stops = sorted({s for s in stops if s}, key=len, reverse=True)
        self.include = include_stop_str_in_output
        self.max_len = max((len(s) for s in self.stops), default=0)
        self.can_end = can_end
        self.emitted = ""  # all text returned so far; kept only for can_end
        self.held = ""
        self.matched: str | None = None

    def feed(self, delta: str) -> tuple[str, str | None]:
        """(text safe to emit now, the stop string matched in this step or None)."""
        if self.matched is not None:
            return "", None
        text = self.held + delta
        hit = self._first_match(text)
        if hit is not None:
            start, stop = hit
            self.held, self.matched = "", stop
            return self._emit(text[:start + len(stop)] if self.include else text[:start]), stop
        keep = self._partial_tail(text)
        self.held = text[len(text) - keep:] if keep else ""
        return self._emit(text[:len(text) - keep]), None

    def flush(self) -> str:
        """Held-back text, when generation ends for another reason."""
        held, self.held = self.held, ""
        return self._emit(held)

    def _emit(self, text: str) -> str:
        if self.can_end is not None:
            self.emitted += text
        return text

    def _first_match(self, text: str) -> tuple[int, str] | None:
        # `held` never contains a whole stop that could end the output, so a match must end inside the
        # new delta; searching all of `text` is still O(len(delta) + max_len) per step because `held`
        # is shorter than max_len.
        if self.can_end is None:
            found = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
            return min(found, key=lambda f: (f[0], -len(f[1]))) if found else None
        for start, stop in sorted(self._occurrences(text), key=lambda f: (f[0], -len(f[1]))):
            end = start + len(stop) if self.include else start
            if self.can_end(self.emitted + text[:end]):
                return start, stop
        return None

    def _occurrences(self, text: str) -> list[tuple[int, str]]:
        found = []
        for s in self.stops:
            i = text.find(s)
            while i >= 0:
                found.append((i, s))
                i = text.find(s, i + 1)
        return found

    def _partial_tail(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        for k in range(min(self.max_len - 1, len(text)), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0
