"""Incremental detokenization: token ids in, text deltas out, in O(new tokens) per step.

vLLM's offsets approach: decode a short window `ids[prefix:]` and subtract the decode of
`ids[prefix:read]` (the text already emitted for those tokens). The window starts one emitted chunk
back, so a decoder that treats the first token specially (SentencePiece's leading-space strip) and
byte tokens that only form a character together both come out right.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from forge_service.tokenizer.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text deltas of one completion. `text` is everything emitted so far.

    A delta never ends in half a UTF-8 character: while the window decodes to a trailing U+FFFD the
    text is held back. The deltas (plus `flush()` at the end) concatenate to `decode(all output ids)`.
    `prompt_token_ids` is accepted for interface stability; the output text is defined on the output
    ids alone (as `decode(output_ids)`), so it does not depend on the prompt.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.prompt_len = len(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # ids before this have been emitted as text
        self.text = ""

    def add(self, new_token_ids: list[int]) -> str:
        """Append tokens; return the newly completed text (possibly empty)."""
        self.ids.extend(new_token_ids)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        window_text = self._decode(self.prefix_offset, len(self.ids))
        if window_text.endswith(REPLACEMENT) or len(window_text) <= len(prefix_text):
            return ""  # an unfinished character (or nothing visible yet): wait for more tokens
        delta = window_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of generation: whatever is still held back (e.g. bytes that never formed a character)."""
        full = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        self.prefix_offset = self.read_offset = len(self.ids)
        if not full.startswith(self.text):
            return ""  # emitted text can not be taken back; this only happens with pathological decoders
        delta = full[len(self.text):]
        self.text = full
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        return self.tokenizer.decode(self.ids[start:end], skip_special_tokens=self.skip_special_tokens)
