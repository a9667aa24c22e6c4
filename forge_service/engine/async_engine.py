"""The engine thread and one asyncio stream of outputs per request.

The synchronous engine is not thread-safe, so only one thread (the engine thread) ever calls
it. The event loop talks to that thread through a command deque guarded by a condition
variable; the thread answers through `loop.call_soon_threadsafe`, posting a large step's outputs
as the next step's model run starts (or at once when no step follows).
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Protocol

from forge_service.engine.request import SamplingParams
from forge_service.errors import ForgeError, InvalidArgument, QueueFull, Unavailable

log = logging.getLogger(__name__)

# After a failed step the loop retries with this backoff (seconds), so that an engine that
# keeps failing does not spin a core; any new command wakes it early.
_FAILURE_BACKOFF_S = (0.01, 0.1, 1.0)
# A step with at least this many outputs posts them as the next step's model run starts: their
# per-token work on the event loop (~0.2 ms of a core each) then overlaps the native step, which
# runs without the GIL, instead of taking the GIL from the engine thread's Python between steps.
# Smaller steps post at once: on a 2-core CPU their work fits into the engine's Python between
# steps, where the OpenMP worker only spins, and overlapping it would preempt a thread of a step
# whose kernels meet at barriers. (Through the gateway on a 2-vCPU Zen 4, holding every step's
# outputs: c=1 / 4 / 16 -9% / -11% / -4%, c=32 / 64 +3%.)
HOLD_OUTPUTS_FROM = 32


class SyncEngine(Protocol):
    """What AsyncEngine needs from forge_service.engine.engine.LLMEngine."""

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None: ...
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    label: str | None = None) -> None: ...
    def abort_request(self, request_id: str, reason: str = "abort") -> None: ...
    def step(self, on_launch: Callable[[], None] | None = None) -> list[Any]: ...
    def has_unfinished_requests(self) -> bool: ...
    def stats(self) -> Any: ...


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    label: str | None


@dataclass(frozen=True)
class _Abort:
    request_id: str


class AsyncEngine:
    """Runs an engine's step loop on a dedicated thread and streams each request's outputs.

    `generate` yields the engine's delta RequestOutputs for one request until it finishes; if
    the consumer stops early or is cancelled, the request is aborted in the engine. A request
    that the engine failed alone (an output with `error` set) fails with INTERNAL and that
    message; the others go on. If the engine's `step` itself raises, every request in flight
    fails with INTERNAL and the loop goes on.
    """

    def __init__(self, engine: SyncEngine, max_waiting: int = 0, hold_outputs_from: int = HOLD_OUTPUTS_FROM) -> None:
        self.engine = engine
        self._max_waiting = max_waiting
        self._hold_outputs_from = hold_outputs_from
        self._commands: collections.deque[_Add | _Abort] = collections.deque()
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Event-loop side: the stream of each request in flight.
        self._streams: dict[str, asyncio.Queue[Any]] = {}
        self._adds_submitted = 0
        # Engine-thread side (read by the loop only as plain ints / references).
        self._live: set[str] = set()
        self._adds_processed = 0
        self._stats = engine.stats()
        self._failures = 0
        self._held: list[Any] = []  # the last step's outputs, posted when the next step launches

    # ---- event-loop side -------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        assert self._thread is None, "AsyncEngine.start called twice"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="forge-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the thread; requests still in flight are aborted and fail with UNAVAILABLE."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        for request_id in list(self._streams):
            self._fail(request_id, Unavailable("the engine shut down"))

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def stats(self) -> Any:
        """The engine's stats as of its last step (an EngineStats)."""
        return self._stats

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Check a request before queueing it; reads only immutable engine state, so any thread may call it."""
        self.engine.validate(prompt_token_ids, params)

    async def compile_constraint(self, params: SamplingParams) -> None:
        """Compile params.constraint off the event loop and the engine thread (the grammar
        compiler's pool), raising InvalidArgument with the backend's reason (QueueFull where compiles
        are backed up, or one waited too long for a core). The request then
        reaches add_request as a cache hit, so the step loop never waits on a compile."""
        if params.constraint is None:
            return
        compiler = getattr(self.engine, "grammar_compiler", None)
        if compiler is None:
            raise InvalidArgument("this engine does not support structured output")
        # shield: a cancelled RPC must not cancel a compile that other requests may share.
        await asyncio.shield(asyncio.wrap_future(compiler.compile_async(params.constraint)))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       label: str | None = None) -> AsyncIterator[Any]:
        """Submit a request and yield its RequestOutputs (deltas) until it finishes. Deltas that
        queued up while the consumer was busy come as one (RequestOutput.extend).

        `request_id` keys the request in the engine: the caller makes a fresh one (uuid4) per
        request. `label` is the client's own id, for logs and traces; it may repeat."""
        self._admit(request_id, params.n)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = queue
        self._adds_submitted += params.n
        self._submit(_Add(request_id, list(prompt_token_ids), params, label))
        finished = False
        failure: BaseException | None = None  # came after deltas that are yielded first
        try:
            while True:
                item = failure or await queue.get()
                if isinstance(item, BaseException):
                    finished = True  # failed requests are already out of the engine
                    raise item
                # A consumer that fell behind takes what has queued up as one delta: one message
                # to write instead of one per step, with the same tokens in the same order.
                while not item.finished and not queue.empty():
                    later = queue.get_nowait()
                    if isinstance(later, BaseException):
                        failure = later
                        break
                    item.extend(later)
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(_Abort(request_id))

    def _admit(self, request_id: str, n: int) -> None:
        if not self.running:
            raise Unavailable("the engine is not running")
        if request_id in self._streams:
            raise InvalidArgument(f"request id {request_id!r} is already in flight")
        if self._max_waiting <= 0:
            return
        # Sequences, as the engine counts them: a request with n completions takes n places.
        waiting = self._stats.num_waiting + self._adds_submitted - self._adds_processed
        if waiting + n > self._max_waiting:
            adds = f" and this request adds {n}" if n > 1 else ""
            raise QueueFull(f"the waiting queue is full: {waiting} requests waiting{adds}, "
                            f"the bound is {self._max_waiting}; retry later")

    def _submit(self, command: _Add | _Abort) -> None:
        with self._wakeup:
            self._commands.append(command)
            self._wakeup.notify()

    def _dispatch(self, outputs: list[Any]) -> None:
        for output in outputs:
            queue = self._streams.get(output.request_id)
            if queue is None:  # the consumer left and the abort is on its way
                continue
            error = getattr(output, "error", None)  # the engine failed this request alone
            queue.put_nowait(ForgeError(error) if error else output)

    def _fail(self, request_id: str, error: BaseException) -> None:
        queue = self._streams.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    # ---- engine-thread side ----------------------------------------------------------

    def _run(self) -> None:
        while True:
            commands = self._wait_for_work()
            if commands is None:
                break
            try:
                self._apply(commands)
                if self.engine.has_unfinished_requests():
                    self._step()
            except Exception:  # the engine failed: fail what is in flight, keep the loop alive
                self._on_step_failure()
        self._release_held()
        self._abort_all()

    def _wait_for_work(self) -> list[_Add | _Abort] | None:
        """The queued commands; blocks while there is nothing to do. None: stop."""
        with self._wakeup:
            if self._failures:
                backoff = _FAILURE_BACKOFF_S[min(self._failures, len(_FAILURE_BACKOFF_S)) - 1]
                self._wakeup.wait_for(lambda: self._commands or self._stopping, timeout=backoff)
            while not (self._commands or self._stopping or self._engine_busy()):
                self._release_held()  # no step follows
                self._wakeup.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _engine_busy(self) -> bool:
        try:
            return self.engine.has_unfinished_requests()
        except Exception:
            log.exception("has_unfinished_requests() failed")
            return False

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        adds = 0
        for command in commands:
            if isinstance(command, _Add):
                adds += command.params.n
                self._add(command)
            elif command.request_id in self._live:
                self._live.discard(command.request_id)
                self._abort_quietly(command.request_id)
        self._publish_stats()
        self._adds_processed += adds

    def _add(self, command: _Add) -> None:
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                    label=command.label)
        except ForgeError as error:
            self._post(self._fail, command.request_id, error)
        except Exception:  # a bug in the engine: this request fails, the others go on
            error_id = uuid.uuid4().hex[:12]
            log.exception("add_request(%s) failed [error id %s]", command.request_id, error_id)
            self._post(self._fail, command.request_id, ForgeError(f"internal error [error id {error_id}]"))
        else:
            self._live.add(command.request_id)

    def _step(self) -> None:
        outputs = self.engine.step(on_launch=self._release_held)
        self._release_held()  # a step that ran no model
        self._failures = 0
        for output in outputs:
            if output.finished:
                self._live.discard(output.request_id)
        self._publish_stats()
        if len(outputs) >= self._hold_outputs_from:
            self._held = outputs
        elif outputs:
            self._post(self._dispatch, outputs)

    def _release_held(self) -> None:
        """Post the held outputs of the last step (HOLD_OUTPUTS_FROM): as the next step hands its
        batch to the model, or at once when no step follows."""
        if self._held:
            outputs, self._held = self._held, []
            self._post(self._dispatch, outputs)

    def _on_step_failure(self) -> None:
        self._release_held()
        error_id = uuid.uuid4().hex[:12]
        failed = sorted(self._live)
        log.exception("engine step failed [error id %s]; failing %d requests", error_id, len(failed))
        self._failures += 1
        self._live.clear()
        for request_id in failed:
            self._abort_quietly(request_id, "error")
            self._post(self._fail, request_id, ForgeError(f"internal engine error [error id {error_id}]"))

    def _abort_all(self) -> None:
        for request_id in sorted(self._live):
            self._abort_quietly(request_id)
        self._live.clear()

    def _abort_quietly(self, request_id: str, reason: str = "abort") -> None:
        try:
            self.engine.abort_request(request_id, reason)
        except Exception:  # the engine is already broken; the request's stream fails anyway
            log.exception("abort_request(%s) failed", request_id)

    def _publish_stats(self) -> None:
        try:
            self._stats = self.engine.stats()
        except Exception:
            log.exception("engine stats() failed; keeping the previous snapshot")

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is left to tell
            log.debug("event loop closed; dropped %s", fn.__name__)
