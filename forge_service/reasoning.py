"""Reasoning output: the text a thinking model writes between <think> and </think> (Qwen3,
DeepSeek-R1 and their distillations, SmolLM3), split from the answer.

A chat completion whose text opens with <think> (after whitespace), or whose prompt ends in an
open <think> (a template that starts the thought itself), is reasoning up to </think> and the
answer after it. A completion that ends before </think> is all reasoning. Anything else is all
answer, as written. Whitespace around a thought and between it and the answer is dropped.

One ReasoningSplitter per completion, fed its text deltas in order; it holds back only what could
still be part of a tag (or whitespace that may end the thought), so streamed deltas split exactly
as the whole text does.
"""
from __future__ import annotations

import functools
from typing import Any

OPEN, CLOSE = "<think>", "</think>"
MODES = ("auto", "think", "off")  # --reasoning-parser


def parses_reasoning(mode: str, template_source: str | None) -> bool:
    """Whether chat completions are split: "think" always, "off" never, "auto" when the model's
    chat template knows the closing tag."""
    return mode == "think" or (mode == "auto" and CLOSE in (template_source or ""))


@functools.lru_cache(maxsize=4)
def close_token(tokenizer: Any) -> int | None:
    """The id of </think> where the tokenizer makes it one token (Qwen3's, DeepSeek-R1's), else
    None; worked out once per tokenizer, not per request."""
    ids = tokenizer.encode(CLOSE, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


def prompt_opens_thought(prompt_tail: str) -> bool:
    """Whether a rendered prompt ends inside a thought (its last tag, trailing whitespace aside, is <think>)."""
    return prompt_tail.rstrip().endswith(OPEN)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest suffix of `text` that begins `tag` (0 if none)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One completion's text deltas -> (thought, answer) pieces; `in_thought`: the prompt opened it."""

    def __init__(self, in_thought: bool = False) -> None:
        # "start": before any text but whitespace (an opening tag may come); "thought"; "answer"
        self._state = "thought" if in_thought else "start"
        self._held = ""  # text not given out yet
        self._lead = True  # at the start of the thought or the answer: whitespace is dropped
        self.thought_seen = False

    @property
    def thought_open(self) -> bool:
        return self._state == "thought"

    @property
    def undecided(self) -> bool:
        """Whether nothing but whitespace or the opening tag's beginning came yet."""
        return self._state == "start"

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) decoded from this delta onwards that can be given out now;
        `thought_seen` then says whether this delta was part of a thought (opened, continued or
        closed one)."""
        self.thought_seen = self._state == "thought"
        self._held += text
        reasoning = answer = ""
        if self._state == "start":
            stripped = self._held.lstrip()
            if stripped.startswith(OPEN):
                self._state, self._held, self.thought_seen = "thought", stripped[len(OPEN):], True
            elif OPEN.startswith(stripped):  # whitespace, or the opening tag's beginning: wait
                return "", ""
            else:  # no thought: the text is the answer as written
                self._state, self._lead = "answer", False
        if self._state == "thought":
            held = self._held
            end = held.find(CLOSE)
            if end < 0:
                return self._thought(held, final=False), ""
            reasoning = self._thought(held[:end], final=True)
            self._state, self._held, self._lead = "answer", held[end + len(CLOSE):], True
        if self._state == "answer":
            answer, self._held = self._answer(self._held), ""
        return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is held at the end of the completion: a thought cut short stays reasoning."""
        held, self._held = self._held, ""
        if self._state == "thought":
            return held.strip() if self._lead else held.rstrip(), ""
        return "", held

    def _thought(self, text: str, final: bool) -> str:
        # Give out the thought but for a possible closing tag's start and its trailing whitespace.
        if self._lead:
            text = text.lstrip()
            if not text:
                self._held = ""
                return ""
        if final:
            self._lead = False
            return text.rstrip()
        keep = _partial_tag(text, CLOSE)
        body = text[:len(text) - keep]
        out = body.rstrip()
        self._held = body[len(out):] + text[len(text) - keep:]
        if out:
            self._lead = False
        return out

    def _answer(self, text: str) -> str:
        if self._lead:
            text = text.lstrip()
            if text:
                self._lead = False
        return text
