"""vLLM's bad_words: words the output may not contain. A word is a token sequence (as written and
with a leading space, the two ways text meets it); its last token is banned wherever the output
already ends with the others, so that no step completes it."""
from __future__ import annotations

from typing import Any

Sequences = tuple[tuple[int, ...], ...]


def bad_word_ids(tokenizer: Any, words: list[str] | None) -> Sequences:
    """Each word's token sequences, without special tokens: at a text's start and after a space."""
    found: dict[tuple[int, ...], None] = {}
    for word in words or []:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                found[ids] = None
    return tuple(found)


def banned_tokens(sequences: Sequences, output: list[int]) -> set[int]:
    """The tokens that would complete a bad word after `output`."""
    banned = set()
    for seq in sequences:
        head = len(seq) - 1
        if head == 0 or (len(output) >= head and tuple(output[len(output) - head:]) == seq[:-1]):
            banned.add(seq[-1])
    return banned
