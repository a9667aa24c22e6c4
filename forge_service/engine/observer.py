"""What the engine reports about each request's life, to one observer. Plain Python.

The engine thread calls the observer; the Prometheus metrics (forge_service.metrics) are one.
`request.times` holds the timestamps (time.monotonic() seconds). The engine updates them
after each call, so an observer sees the times as they were before the event it is told of.
"""
from __future__ import annotations

from typing import Protocol

from forge_service.engine.request import Request


class EngineObserver(Protocol):
    def scheduled(self, request: Request, now: float) -> None:
        """First scheduled (left the queue); request.num_cached_tokens is its prefix-cache hit."""

    def preempted(self, request: Request) -> None:
        """Its blocks were freed; it waits to be recomputed."""

    def token(self, request: Request, now: float) -> None:
        """One output token reached the request's output (times.first_token is None for its first)."""

    def finished(self, request: Request, reason: str, now: float) -> None:
        """Ended: "stop", "length", "abort" or "error"."""

    def step(self, batch_size: int, num_tokens: int, duration_s: float) -> None:
        """One engine step ran `batch_size` requests over `num_tokens` tokens."""


class NullObserver:
    """Observes nothing (offline use, tests)."""

    def scheduled(self, request: Request, now: float) -> None:
        pass

    def preempted(self, request: Request) -> None:
        pass

    def token(self, request: Request, now: float) -> None:
        pass

    def finished(self, request: Request, reason: str, now: float) -> None:
        pass

    def step(self, batch_size: int, num_tokens: int, duration_s: float) -> None:
        pass
