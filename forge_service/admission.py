"""Tokenizing off the event loop: a bounded pool, and a length check that needs no tokenizing.

Rendering a chat template and tokenizing run in the pool's threads, so a huge prompt never
stalls health checks or other requests on the event loop. (HF `tokenizers` releases the GIL in
`encode_batch`, which Tokenizer.encode uses, but not in `encode`.) The pool's queue is bounded:
past `max_pending` requests waiting for it, a new one gets QueueFull (RESOURCE_EXHAUSTED).
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from forge_service.errors import CONTEXT_LENGTH_EXCEEDED, InvalidArgument, QueueFull

T = TypeVar("T")


class TokenizerPool:
    """A fixed pool of worker threads with a bound on the work it holds (queued or running)."""

    def __init__(self, workers: int, max_pending: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=max(workers, 1), thread_name_prefix="forge-tokenize")
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()

    @property
    def pending(self) -> int:
        return self._pending

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a worker. A cancelled caller frees its slot once its work has left the pool."""
        with self._lock:
            if self._pending >= self._max_pending:
                raise QueueFull(f"the tokenizer queue is full: {self._pending} requests are being tokenized or "
                                f"waiting for it (--max-pending-tokenize {self._max_pending}); retry later")
            self._pending += 1
        future = self._executor.submit(fn, *args)
        future.add_done_callback(self._release)
        return await asyncio.wrap_future(future)

    def _release(self, future: Future[Any]) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def longest_token_chars(tokenizer: Any) -> int | None:
    """The most characters any one token can stand for, or None when that gives no lower bound.

    Each token stands for at most its byte length in characters (a character is at least one byte),
    so a text of C characters needs at least C / longest tokens. That holds only while the tokenizer
    does not shorten text before splitting it (composing or stripping normalizers do)."""
    token_bytes = getattr(tokenizer, "token_bytes", None)
    backend = getattr(tokenizer, "backend", None)
    if token_bytes is None or not _keeps_length(getattr(backend, "normalizer", None)):
        return None
    return max((len(token_bytes(i)) for i in range(tokenizer.vocab_size)), default=0) or None


# Normalizers that never make a text shorter (Replace is checked pattern by pattern).
_LENGTH_KEEPING = {"Prepend", "Lowercase", "NFD", "NFKD"}


def _keeps_length(normalizer: Any) -> bool:
    if normalizer is None:
        return True
    import json

    spec = json.loads(normalizer.__getstate__()) if hasattr(normalizer, "__getstate__") else None
    return spec is not None and _spec_keeps_length(spec)


def _spec_keeps_length(spec: dict[str, Any]) -> bool:
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_spec_keeps_length(child) for child in spec.get("normalizers", []))
    if kind == "Replace":
        pattern = spec.get("pattern", {})
        return "String" in pattern and len(spec.get("content", "")) >= len(pattern["String"])
    return kind in _LENGTH_KEEPING


def check_prompt_chars(chars: int, longest: int | None, max_model_len: int) -> None:
    """Refuse a prompt of `chars` characters whose token count is bound to reach the context."""
    if not longest:
        return
    at_least = -(-chars // longest)
    if at_least >= max_model_len:
        raise InvalidArgument(
            f"the prompt has {chars} characters, so at least {at_least} tokens (no token is longer than "
            f"{longest} characters), but the model's context length is {max_model_len} and at least one token "
            f"must be generated: shorten the prompt (by {at_least - max_model_len + 1} tokens or more)",
            kind=CONTEXT_LENGTH_EXCEEDED)
