"""The engine's entry point to structured output: a cached, off-loop grammar compiler and matchers.

The engine creates one GrammarCompiler per tokenizer at start-up, calls `compile_async` when a
constrained request arrives (the request waits until the future is done; the step loop never
blocks on a compile), builds one GrammarMatcher per sequence, and each step fills a packed
bitmask (see bitmask.py) for the constrained rows before sampling.

Constraints come from clients, so a compile is bounded three ways: the spec's size
(`max_spec_bytes`), the backend's own work limits (llguidance's lexer fuel and state caps,
llguidance_backend.py), and a time limit, `compile_timeout_s`, after which the request gets
INVALID_ARGUMENT whatever the compile thread is still doing. The limit is on the CPU time the
compiling thread has used, not on the wall clock: on a busy server (the step's threads on every
core) a compile of a few milliseconds can wait far longer than that for a core or the GIL, and a
wall-clock limit refused it for the server's load rather than for its own work. A compile that
gets no CPU at all is still bounded: past WALL_FACTOR times the limit in wall-clock time it is
refused with RESOURCE_EXHAUSTED (the server's load, worth retrying). Where the platform gives no
clock for another thread's CPU time, the limit is on the wall clock alone. Compile threads get a
large stack: the backend recurses over a grammar's rule chains, and a deep chain must not overflow
it.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

import torch
from tokenizers import Tokenizer

from forge_service.errors import InvalidArgument, QueueFull
from forge_service.structured.backend import BACKENDS, DEFAULT_BACKEND, BackendGrammar, GrammarBackend, create_backend
from forge_service.structured.bitmask import pack_bitmask
from forge_service.structured.constraint import Constraint


MAX_SPEC_BYTES = 128 * 1024  # OpenAI allows ~120k characters of names and values in one schema
COMPILE_TIMEOUT_S = 0.5  # of the compiling thread's CPU time
WALL_FACTOR = 10  # a compile waiting for CPU is refused past this many times its limit in wall-clock time
MAX_QUEUED_COMPILES = 64  # compiles waiting for a thread; more are refused (RESOURCE_EXHAUSTED)
COMPILE_STACK_BYTES = 256 * 1024 * 1024  # reserved, not committed: ~2.7 KB per level of rule chain
_STACK_SIZE_LOCK = threading.Lock()  # threading.stack_size is process-wide: set it only around a spawn


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A constraint compiled for one tokenizer. Immutable and shared; equal to itself only."""

    constraint: Constraint
    grammar: BackendGrammar
    vocab_size: int
    eos_token_ids: frozenset[int]
    eos_only_row: torch.Tensor  # [W] int32: the mask of a terminated matcher

    def accepts(self, text: str) -> bool:
        """Whether `text` is a complete output: the grammar would allow EOS right after it."""
        return self.grammar.accepts_text(text)


class GrammarCompiler:
    """Compiles constraints for one tokenizer; thread-safe.

    Results are cached by constraint (the compiler is per tokenizer, so the key is
    (constraint, tokenizer)): a repeated schema returns the same CompiledGrammar without
    work, and concurrent requests for one schema share one compile. Failed compiles are not
    cached; they raise forge_service.errors.InvalidArgument with the backend's reason, or
    when the spec is over `max_spec_bytes` or the compile uses more than `compile_timeout_s`
    of CPU time; a compile that takes WALL_FACTOR times that in wall-clock time without using it
    raises forge_service.errors.QueueFull (RESOURCE_EXHAUSTED).
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int], *,
                 backend: str = DEFAULT_BACKEND, max_cached: int = 512, compile_threads: int = 2,
                 max_spec_bytes: int = MAX_SPEC_BYTES, compile_timeout_s: float = COMPILE_TIMEOUT_S,
                 max_queued: int = MAX_QUEUED_COMPILES) -> None:
        if backend not in BACKENDS:  # a deployment setting, checked at start-up
            raise ValueError(f"unknown structured output backend {backend!r}; expected one of {sorted(BACKENDS)}")
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._backend_args = (backend, tokenizer, vocab_size, sorted(self.eos_token_ids))
        self._backend: GrammarBackend | None = None
        eos_only = torch.zeros(1, vocab_size, dtype=torch.bool)
        eos_only[0, sorted(self.eos_token_ids)] = True
        self._eos_only_row = pack_bitmask(eos_only)[0]
        self._max_cached = max_cached
        self.max_spec_bytes = max_spec_bytes
        self.compile_timeout_s = compile_timeout_s
        self._max_queued = max_queued
        self._queued = 0  # submitted, not yet started
        self._cache: OrderedDict[Constraint, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._backend_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=compile_threads, thread_name_prefix="forge-grammar")

    @property
    def backend(self) -> GrammarBackend:
        """The backend, built on first use: llguidance indexes the vocabulary (~0.5 s), so an
        engine that never sees a constraint never pays for it, and compiles pay for it off-loop."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = create_backend(*self._backend_args)
            return self._backend

    def compile_async(self, constraint: Constraint) -> Future[CompiledGrammar]:
        """A future for the compiled grammar; done at once on a cache hit or a refusal. Never blocks."""
        with self._lock:
            future = self._cache.get(constraint)
            if future is not None:
                self._cache.move_to_end(constraint)
                return future
            refusal = self._refusal(constraint)
            if refusal is not None:
                future = Future()
                future.set_exception(refusal)
                return future
            future = Future()
            self._cache[constraint] = future
            self._queued += 1
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        future.add_done_callback(lambda f: self._forget_failure(constraint, f))
        self._submit(constraint, future)
        return future

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        """Compile (or fetch) now; raises InvalidArgument(reason)."""
        return self.compile_async(constraint).result()

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                      rows: Sequence[int] | None = None) -> None:
        """Fill `rows` (default 0..len-1) of bitmask [N, W] int32 for many matchers, in parallel.

        At batch 16 this is ~2x faster than one `fill_mask` per matcher (bench/structured_backends.py).
        Terminated matchers get EOS only.
        """
        rows = range(len(matchers)) if rows is None else rows
        live = [(m, r) for m, r in zip(matchers, rows) if not m.is_terminated()]
        if live:
            self.backend.fill_bitmasks([m._inner for m, _ in live], bitmask, [r for _, r in live])
        for m, r in zip(matchers, rows):
            if m.is_terminated():
                m.fill_mask(bitmask, r)

    def clear_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def cached(self, constraint: Constraint) -> bool:
        with self._lock:
            return constraint in self._cache

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            pending = list(self._cache.values())
        for future in pending:
            future.cancel()  # only those no thread has started; a running compile settles itself

    def _refusal(self, constraint: Constraint) -> Exception | None:
        if not self.eos_token_ids:  # nothing could end a constrained output
            return InvalidArgument("structured output needs an end-of-sequence token, and this model has none")
        size = len(constraint.spec.encode("utf-8"))
        if size > self.max_spec_bytes:
            return InvalidArgument(f"structured output {constraint.kind} is {size} bytes; "
                                   f"the limit is {self.max_spec_bytes}")
        if self._queued >= self._max_queued:
            return QueueFull(f"{self._queued} structured output grammars are waiting to compile; retry later")
        return None

    def _submit(self, constraint: Constraint, future: Future[CompiledGrammar]) -> None:
        with _STACK_SIZE_LOCK:  # a worker the pool starts now gets the large stack
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                self._pool.submit(self._run, constraint, future)
            finally:
                threading.stack_size(previous)

    def _run(self, constraint: Constraint, future: Future[CompiledGrammar]) -> None:
        """Compile into `future` (on a pool thread), failing it when the compile overruns its time."""
        with self._lock:
            self._queued -= 1
        if not future.set_running_or_notify_cancel():
            return
        finished = threading.Event()
        try:
            self.backend  # noqa: B018 -- indexing the vocabulary is start-up work, outside the time limit
            threading.Thread(target=_watch, args=(future, finished, constraint.kind, self.compile_timeout_s,
                                                  _thread_cpu_clock()),
                             name="forge-grammar-watch", daemon=True).start()
            _settle(future, self._compile(constraint), None)
        except Exception as e:  # handed to the waiting request, which reports it
            _settle(future, None, e)
        finally:
            finished.set()

    def _compile(self, constraint: Constraint) -> CompiledGrammar:
        grammar = self.backend.compile(constraint)
        return CompiledGrammar(constraint, grammar, self.vocab_size, self.eos_token_ids, self._eos_only_row)

    def _forget_failure(self, constraint: Constraint, future: Future[CompiledGrammar]) -> None:
        if future.cancelled() or future.exception() is not None:
            with self._lock:
                if self._cache.get(constraint) is future:
                    del self._cache[constraint]


def _thread_cpu_clock() -> int | None:
    """The calling thread's CPU-time clock, which other threads can read; None where there is none."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):  # not on this platform
        return None


def _watch(future: Future[CompiledGrammar], finished: threading.Event, kind: str, limit_s: float,
           clock: int | None) -> None:
    """Fail `future` once its compile (on the thread whose CPU clock is `clock`) has used `limit_s` of
    CPU time (INVALID_ARGUMENT: the constraint's own work), or has taken WALL_FACTOR * limit_s in
    wall-clock time without that (RESOURCE_EXHAUSTED: the server's load; worth retrying); return once
    `finished` is set. Without a clock, `limit_s` of wall-clock time is INVALID_ARGUMENT. The pool's
    threads outlive a compile, so CPU time counts from the compile's start; and it grows no faster
    than the wall clock, so waiting for what is left of the limit never overshoots it."""
    start_wall = time.monotonic()
    try:
        start_cpu = time.clock_gettime(clock) if clock is not None else 0.0
        while not finished.is_set():
            wall_s = time.monotonic() - start_wall
            cpu_s = time.clock_gettime(clock) - start_cpu if clock is not None else wall_s
            if cpu_s >= limit_s:
                what = "of CPU time" if clock is not None else "(wall clock)"
                _settle(future, None, InvalidArgument(
                    f"structured output {kind} did not compile within {limit_s:g} s {what}; simplify it"))
                return
            if wall_s >= WALL_FACTOR * limit_s:
                _settle(future, None, QueueFull(
                    f"structured output {kind} waited {wall_s:.3g} s for a core to compile on ({cpu_s:.3g} s "
                    f"of CPU time used of its {limit_s:g} s); the server is busy, retry later"))
                return
            finished.wait(min(limit_s - cpu_s, WALL_FACTOR * limit_s - wall_s))
    except OSError:  # the compile's thread is gone: the compile is over
        return


def _settle(future: Future[CompiledGrammar], result: CompiledGrammar | None, error: Exception | None) -> None:
    """Complete `future` unless it already is: a compile and its watch (_watch) race, and the first
    one wins."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except InvalidStateError:  # the other one finished it first
        return


class GrammarMatcher:
    """One sequence's progress through a grammar. Not thread-safe; owned by the engine thread.

    EOS is accepted exactly when the output so far is complete (`can_end`); the matcher is then
    terminated: it accepts nothing more and its mask allows only EOS, so a sampled row is never
    all -inf. Rolling back past the EOS revives it.
    """

    def __init__(self, grammar: CompiledGrammar) -> None:
        self.grammar = grammar
        self._inner = grammar.grammar.matcher()
        self._num_tokens = 0  # accepted tokens, EOS included; bounds rollback
        self._terminated = False

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token. False (and no change) when the grammar forbids it."""
        if self._terminated or not 0 <= token_id < self.grammar.vocab_size:
            return False
        if token_id in self.grammar.eos_token_ids:
            if not self._inner.is_accepting():
                return False
            self._terminated = True
        elif not self._inner.accept_token(token_id):
            return False
        self._num_tokens += 1
        return True

    def accept_prefix(self, token_ids: Sequence[int]) -> int:
        """Advance by the longest prefix of `token_ids` the grammar allows; returns its length
        (a speculative draft is checked this way, then rolled back)."""
        accepted = 0
        for token_id in token_ids:
            if not self.accept_token(token_id):
                break
            accepted += 1
        return accepted

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row `row` of a packed bitmask [N, ceil(V / 32)] int32 (CPU, contiguous); 1 = allowed."""
        if self._terminated:
            bitmask[row] = self.grammar.eos_only_row
        else:
            self._inner.fill_bitmask(bitmask, row)

    def can_end(self) -> bool:
        """True when the output so far is complete, so EOS is allowed now."""
        return not self._terminated and self._inner.is_accepting()

    def is_terminated(self) -> bool:
        return self._terminated

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def rollback(self, num_tokens: int) -> bool:
        """Undo the last `num_tokens` accepted tokens (speculative decoding). False if there are fewer."""
        if not 0 <= num_tokens <= self._num_tokens:
            return False
        inner = num_tokens - 1 if self._terminated and num_tokens else num_tokens  # the EOS was never inner
        if inner:
            self._inner.rollback(inner)
        self._terminated = self._terminated and num_tokens == 0
        self._num_tokens -= num_tokens
        return True

    def reset(self) -> None:
        self._inner.reset()
        self._num_tokens = 0
        self._terminated = False
