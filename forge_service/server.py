"""The gRPC service on grpc.aio: binding, health, reflection, loading the engine, admission, draining and
stopping. The Forge servicer (servicer.py) answers its calls."""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import gc
import logging
import signal
import socket
import threading
import time
from typing import Any, Callable, Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry.trace import Tracer

from forge_service import auth, convert, embeddings
from forge_service.admission import TokenizerPool, check_prompt_chars, longest_token_chars
from forge_service.config import EngineConfig, ServiceConfig, malloc_arenas
from forge_service.engine.async_engine import AsyncEngine, SyncEngine
from forge_service.errors import InvalidArgument, StartupError, Unavailable, blame
from forge_service.metrics import ServiceMetrics, metrics_endpoint
from forge_service.prepare import LoadedModel, Prepared, check_model, prepare_request, tokenize_request
from forge_service.rpc_observer import RpcRecord, observe_rpc
from forge_service.servicer import ForgeServicer
from forge_service.tracing import MonotonicClock, traced
from forge_service.wire import UndecodableRequestGuard
from forge_service.pb import forge_pb2 as pb
from forge_service.pb import forge_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Forge"].full_name  # "forge.v1.Forge"
_SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
    ("grpc.so_reuseport", 0),  # a second server on a taken port must fail, not share it
    # Clients (the gateway) ping every 20 s to find dead connections; allow it, even between calls.
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    # Close each connection after a few minutes (streams in flight keep it up to 11 min more), so
    # that clients resolving a headless Service by DNS re-resolve and find replicas added since.
    ("grpc.max_connection_age_ms", 180_000),
    ("grpc.max_connection_age_grace_ms", 660_000),
]
class Phase(enum.Enum):
    LOADING = pb.SERVING_STATE_LOADING
    READY = pb.SERVING_STATE_READY
    DRAINING = pb.SERVING_STATE_DRAINING


def _listen(server: grpc.aio.Server, address: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Add a listening port to `server` (the port it got); StartupError if it cannot be bound."""
    try:
        return server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError:  # gRPC says only that binding failed; its log line says why
        raise StartupError(f"cannot listen for gRPC on {address}: the address is in use or not this host's") from None


class ForgeService:
    """The gRPC server's lifecycle: bind, load the engine, serve, drain, stop.

    Readiness ("forge.v1.Forge" in grpc.health.v1) is NOT_SERVING while loading and while
    draining; liveness ("") is SERVING from bind to stop.
    """

    def __init__(self, config: ServiceConfig, engine_factory: Callable[[], SyncEngine],
                 max_waiting: int = 0, model_name: str = "", tracer: Tracer | None = None) -> None:
        self.config = config
        self.metrics = ServiceMetrics()
        self.tracer = tracer  # None: tracing off
        self._clock = MonotonicClock()
        self._engine_factory = engine_factory
        self._max_waiting = max_waiting
        self._configured_name = model_name
        self.phase = Phase.LOADING
        self.model: LoadedModel | None = None
        self.port = 0
        self._health = health.aio.HealthServicer()
        self._server: grpc.aio.Server | None = None
        self._in_flight = 0
        self._admitted = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._tokenizers = TokenizerPool(config.tokenizer_workers, config.max_pending_tokenize)

    async def start(self, local_socket: str | None = None) -> int:
        """Bind and start serving (health and reflection answer at once); returns the port.

        `local_socket`: also listen, in plaintext, on this Unix socket (`forge serve`'s own gateway
        uses it when the port has TLS; the API key still applies)."""
        credentials = auth.server_credentials(self.config)
        server = grpc.aio.server(options=_SERVER_OPTIONS,
                                 interceptors=[*auth.interceptors(self.config), UndecodableRequestGuard()])
        pb_grpc.add_ForgeServicer_to_server(ForgeServicer(self), server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        if auth.reflection_enabled(self.config):
            names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, server)
        address = f"{self.config.host}:{self.config.grpc_port}"
        self.port = _listen(server, address, credentials)
        if local_socket is not None:
            _listen(server, f"unix:{local_socket}")
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        self._server = server
        log.info("gRPC server listening on %s:%d (loading the model)", self.config.host, self.port)
        return self.port

    async def load(self) -> None:
        """Build the engine off the event loop, start its thread, and turn readiness on."""
        started = time.monotonic()
        engine = await _in_daemon_thread(self._engine_factory)
        longest = await _in_daemon_thread(lambda: longest_token_chars(engine.tokenizer))
        async_engine = AsyncEngine(engine, max_waiting=self._max_waiting)
        if self.config.metrics_port:  # 0: no metrics, nothing observed on the engine thread
            engine.observer = self.metrics.watch(engine.model_name, async_engine.stats)
        async_engine.start()
        arch = getattr(engine, "arch", None)
        self.model = LoadedModel(async_engine, engine.tokenizer, engine.model_name, engine.max_model_len,
                                 int(time.time()), longest, getattr(arch, "hidden_size", None),
                                 tuple(getattr(engine, "adapters", ())), dict(getattr(engine, "sampling_defaults", {})))
        # What loading made lives as long as the process: out of the collector's full passes, which
        # would otherwise walk it all (~190k objects on the default model, 70-220 ms with the GIL
        # held, stalling every stream) a few times a minute under load.
        gc.collect()
        gc.freeze()
        if self.phase is Phase.LOADING:
            self.phase = Phase.READY
            await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("model %s ready in %.1f s", engine.model_name, time.monotonic() - started)

    def observe(self, method: str, request: pb.GenerateRequest,
                context: grpc.aio.ServicerContext) -> contextlib.AbstractContextManager[RpcRecord]:
        """The RPC's request id, server span and completion log line (forge_service.rpc_observer)."""
        return observe_rpc(method, request, context, self.tracer, self._clock)

    @contextlib.contextmanager
    def track(self) -> Iterator[LoadedModel]:
        """Admit one generation RPC (UNAVAILABLE unless ready) and count it until it ends."""
        if self.phase is not Phase.READY or self.model is None:
            raise Unavailable(f"the service is {self.phase.name.lower()}; retry on another replica or later")
        self._in_flight += 1
        self._admitted += 1
        self._idle.clear()
        try:
            yield self.model
        finally:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    async def prepare(self, request: pb.GenerateRequest, model: LoadedModel) -> Prepared:
        """Check, tokenize (in the tokenizer pool) and compile one request for `model`."""
        return await prepare_request(request, model, self.config, self._tokenizers)

    async def embed_prompts(self, request: pb.EmbedRequest, model: LoadedModel) -> list[list[int]]:
        """An Embed request's inputs as token ids (in the tokenizer pool), each checked (its model
        is checked before: see Embed)."""
        if not 1 <= len(request.inputs) <= embeddings.MAX_INPUTS:
            raise InvalidArgument(f"inputs must hold 1 to {embeddings.MAX_INPUTS} texts, got {len(request.inputs)}",
                                  field="inputs")
        if request.HasField("dimensions") and model.hidden_size is not None:
            embeddings.check_dimensions(request.dimensions, model.hidden_size)
        for i, item in enumerate(request.inputs):
            if item.WhichOneof("input") == "text":
                with blame(f"inputs[{i}]"):
                    check_prompt_chars(len(item.text), model.longest_token_chars, model.max_model_len)
        return await self._tokenizers.run(lambda: [
            embeddings.input_token_ids(i, item, model.tokenizer, model.max_model_len)
            for i, item in enumerate(request.inputs)])

    async def tokenize(self, request: pb.GenerateRequest, model: LoadedModel) -> list[int]:
        """A request's prompt tokens (in the tokenizer pool), checked as far as tokenizing needs."""
        return await tokenize_request(request, model, self.config, self._tokenizers)

    async def detokenize(self, request: pb.DetokenizeRequest, model: LoadedModel) -> str:
        """A Detokenize request's text (in the tokenizer pool)."""
        check_model(request.model, model)
        return await self._tokenizers.run(convert.detokenized, request, model.tokenizer)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @property
    def replica(self) -> str:
        """This replica's name: host (in Kubernetes, the pod) name and gRPC port."""
        return f"{socket.gethostname()}:{self.port}"

    async def drain(self, timeout_s: float, cut: asyncio.Event | None = None) -> bool:
        """Readiness off, refuse new work, wait for in-flight RPCs; True if they all finished.
        `cut` set (a second signal) ends the wait early."""
        self.phase = Phase.DRAINING
        await self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
        log.info("draining: %d requests in flight, waiting up to %.0f s", self._in_flight, timeout_s)
        cut = cut or asyncio.Event()
        waits = {asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(cut.wait())}
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if self._idle.is_set():
            return True
        why = "told again to stop" if cut.is_set() else "drain timeout"
        log.warning("%s: cancelling %d requests still in flight", why, self._in_flight)
        return False

    async def stop(self) -> None:
        """Cancel what is left, stop the server and the engine thread."""
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace=None)
        if self.model is not None:
            await self.model.engine.shutdown()
        self._tokenizers.shutdown()

    def health_response(self) -> pb.HealthResponse:
        response = pb.HealthResponse(state=self.phase.value, ready=self.phase is Phase.READY,
                                     model=self.model.name if self.model else self._configured_name,
                                     max_waiting=max(self._max_waiting, 0), requests_admitted=self._admitted,
                                     requests_in_flight=self._in_flight, replica=self.replica)
        if self.model is not None:
            stats = self.model.engine.stats()
            response.num_waiting, response.num_running = stats.num_waiting, stats.num_running
            response.kv_cache_usage = stats.kv_usage
            response.kv_blocks_used, response.kv_blocks_total = stats.kv_blocks_used, stats.kv_blocks_total
        return response

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Serve until SIGTERM/SIGINT (or `stop` is set), then drain and stop.

        A model that fails to load stops the server and raises."""
        stop, cut = stop or asyncio.Event(), asyncio.Event()
        with _signals_set(stop, cut):
            loading = asyncio.create_task(self.load())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if loading.done() and loading.exception() is not None:
                stopping.cancel()
                await self.stop()
                raise loading.exception()
            await stopping
            if not loading.done():
                loading.cancel()
            await self.drain(self.config.drain_timeout_s, cut)
            await self.stop()
        log.info("stopped")


@contextlib.contextmanager
def _signals_set(event: asyncio.Event, again: asyncio.Event) -> Iterator[None]:
    """SIGTERM and SIGINT set `event` while inside, and a second one sets `again` (only the main
    thread can catch signals): a second Ctrl-C cuts the drain short, where Python's own handler
    raised KeyboardInterrupt out of the event loop, and a second SIGTERM killed the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, event, again)
    try:
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def _on_signal(sig: int, event: asyncio.Event, again: asyncio.Event) -> None:
    if event.is_set():
        log.info("received %s again: stopping without waiting for the drain", signal.Signals(sig).name)
        again.set()
    else:
        log.info("received %s: draining", signal.Signals(sig).name)
        event.set()


async def _in_daemon_thread(fn: Callable[[], Any]) -> Any:
    """fn() on a daemon thread, so that a signal during a slow model load can still exit."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def target() -> None:
        try:
            result = fn()
        except BaseException as error:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle, future, None, error)
        else:
            loop.call_soon_threadsafe(_settle, future, result, None)

    threading.Thread(target=target, name="forge-load", daemon=True).start()
    return await future


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def engine_factory(engine_config: EngineConfig) -> Callable[[], SyncEngine]:
    """A callable that loads the real engine (slow; runs off the event loop)."""
    def load() -> SyncEngine:
        from forge_service.engine.engine import LLMEngine  # pulls in torch and the model code

        return LLMEngine(engine_config)

    return load


def build_service(engine_config: EngineConfig, service_config: ServiceConfig,
                  tracer: Tracer | None = None) -> ForgeService:
    return ForgeService(service_config, engine_factory(engine_config),
                        max_waiting=engine_config.scheduler.max_waiting,
                        model_name=engine_config.model.served_model_name or "", tracer=tracer)


async def serve_async(engine_config: EngineConfig, service_config: ServiceConfig,
                      tracer: Tracer | None = None) -> None:
    service = build_service(engine_config, service_config, tracer)
    with metrics_endpoint(service.metrics.registry, service_config.host, service_config.metrics_port):
        await service.start()
        await service.run()


_M_ARENA_MAX = -8  # glibc's mallopt parameter


def cap_malloc_arenas(arenas: int | None) -> None:
    """Let the threads that allocate (the event loop, the engine and its OpenMP workers, gRPC's
    pollers, the tokenizers) share `arenas` glibc heaps (None: leave glibc's default, eight per
    core). Each arena keeps what its threads freed, so with one per thread the memory a step
    frees in one is not reused by another: sampled every 0.5 s through a c=1..64 serve run, the
    resident memory besides the KV cache peaked at 0.61 GB, and at 0.53 GB with 2 arenas (same
    throughput). Run it before those threads start; not glibc: nothing to do."""
    if arenas is None:
        return
    try:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas)
    except (OSError, AttributeError):
        pass


def serve(engine_config: EngineConfig, service_config: ServiceConfig) -> None:
    """Run the gRPC service alone until SIGTERM/SIGINT; returns after a clean drain."""
    cap_malloc_arenas(malloc_arenas())
    with traced(service_config.otlp_traces_endpoint, "forge-service") as tracer:
        asyncio.run(serve_async(engine_config, service_config, tracer))
