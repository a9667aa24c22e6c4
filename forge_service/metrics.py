"""The service's Prometheus metrics: the engine observer, gauges read at scrape time, the endpoint.

Every metric is named `forge_*` and labelled with `model_name`. Each ForgeService has its own
registry, so that several can live in one process (tests) and `forge serve`'s gateway metrics
(forge_gateway.metrics) stay on the gateway's port.
"""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from forge_service.engine.request import Request
from forge_service.errors import StartupError

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort", "error")
# Inter-token latency: ~5-100 ms on a 2-core CPU, ~5-30 ms on a GPU, fine steps across both.
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.0175, 0.02, 0.025, 0.03, 0.04, 0.05,
               0.06, 0.075, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)
# Engine step time: a GPU decode step takes a few ms, a 2-core CPU prefill chunk up to seconds.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0,
                   60.0, 120.0, 240.0, 480.0, 960.0)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

_MODEL = ["model_name"]


def batch_size_label(batch_size: int) -> str:
    """The step's batch size rounded up to a power of two (a small, fixed set of label values)."""
    bound = next((b for b in BATCH_BUCKETS if batch_size <= b), None)
    return str(bound) if bound is not None else f"{BATCH_BUCKETS[-1]}+"


class ServiceMetrics:
    """All the service's metrics, on `registry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        r = self.registry

        def counter(name: str, doc: str, labels: list[str] = _MODEL) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple, labels: list[str] = _MODEL) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.prompt_tokens = counter("forge_prompt_tokens", "Prompt tokens of requests that produced output "
                                     "(once per request, as in usage.prompt_tokens).")
        self.generation_tokens = counter("forge_generation_tokens", "Output tokens generated (as in "
                                         "usage.completion_tokens).")
        self.prefix_queried = counter("forge_prefix_cache_queried_tokens", "Prompt tokens looked up in "
                                      "the prefix cache when requests were first scheduled.")
        self.prefix_hits = counter("forge_prefix_cache_hit_tokens", "Prompt tokens whose KV came from the "
                                   "prefix cache.")
        self.preemptions = counter("forge_preemptions", "Requests preempted (KV blocks freed, recomputed later).")
        self.finished = counter("forge_requests_finished", "Completions finished, by reason: stop, length, "
                                "abort (cancelled, deadline, refused), error (engine failure).",
                                _MODEL + ["finished_reason"])
        self.spec_draft = counter("forge_spec_decode_draft_tokens", "Speculative decoding: tokens drafted "
                                  "and verified, over finished completions.")
        self.spec_accepted = counter("forge_spec_decode_accepted_tokens", "Speculative decoding: drafted "
                                     "tokens the model accepted, over finished completions.")
        self.rejected = counter("forge_requests_rejected", "Requests refused because the waiting queue "
                                "was full (RESOURCE_EXHAUSTED).")
        self.ttft = histogram("forge_time_to_first_token_seconds", "From queued in the engine to the "
                              "first output token.", TTFT_BUCKETS)
        self.itl = histogram("forge_inter_token_latency_seconds", "Between consecutive output tokens of "
                             "one completion.", ITL_BUCKETS)
        self.e2e = histogram("forge_e2e_request_latency_seconds", "From queued in the engine to finished.",
                             REQUEST_BUCKETS)
        self.queue_time = histogram("forge_request_queue_time_seconds", "From queued to first scheduled.",
                                    REQUEST_BUCKETS)
        self.prefill_time = histogram("forge_request_prefill_time_seconds", "From first scheduled to the "
                                      "first output token.", REQUEST_BUCKETS)
        self.decode_time = histogram("forge_request_decode_time_seconds", "From the first to the last "
                                     "output token.", REQUEST_BUCKETS)
        self.prompt_length = histogram("forge_request_prompt_tokens", "Prompt length of requests, in tokens.",
                                       TOKEN_BUCKETS)
        self.output_length = histogram("forge_request_generation_tokens", "Output length of completions, "
                                       "in tokens.", TOKEN_BUCKETS)
        self.step_time = histogram("forge_engine_step_duration_seconds", "One engine step (schedule, model, "
                                   "sample), by batch size rounded up to a power of two.", STEP_BUCKETS,
                                   _MODEL + ["batch_size"])
        self.batch_size = histogram("forge_engine_step_batch_size", "Requests in one engine step.",
                                    BATCH_BUCKETS)
        self._model_name = ""
        self._stats: Callable[[], Any] | None = None
        r.register(_EngineGauges(self._gauge_values))

    def watch(self, model_name: str, stats: Callable[[], Any]) -> EngineMetrics:
        """Once the model is loaded: gauges read `stats()` (an EngineStats) at scrape time, and
        the returned observer feeds the rest."""
        self._model_name, self._stats = model_name, stats
        return EngineMetrics(self, model_name)

    def count_rejected(self) -> None:
        self.rejected.labels(self._model_name).inc()

    def _gauge_values(self) -> tuple[str, Any] | None:
        return None if self._stats is None else (self._model_name, self._stats())


class _EngineGauges(Collector):
    """Running/waiting requests and KV-cache occupancy, read from the engine's last stats at scrape
    time (nothing to keep up to date on the hot path)."""

    def __init__(self, values: Callable[[], tuple[str, Any] | None]) -> None:
        self._values = values

    def collect(self) -> Iterator[GaugeMetricFamily]:
        got = self._values()
        specs = [
            ("forge_num_requests_running", "Requests being computed (holding KV blocks).", "num_running"),
            ("forge_num_requests_waiting", "Requests queued, waiting to be scheduled.", "num_waiting"),
            ("forge_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use (0-1).", "kv_usage"),
            ("forge_kv_cache_blocks_total", "KV-cache blocks.", "kv_blocks_total"),
            ("forge_kv_cache_blocks_used", "KV-cache blocks in use.", "kv_blocks_used"),
            ("forge_spec_decode_step_base_rows", "Speculative decoding's cost model: a decode step's fixed cost "
             "in rows' worth, measured on the engine's steps or set (0: not drafting).", "spec_step_base_rows"),
        ]
        for name, doc, attribute in specs:
            family = GaugeMetricFamily(name, doc, labels=_MODEL)
            if got is not None:
                family.add_metric([got[0]], float(getattr(got[1], attribute)))
            yield family


class EngineMetrics:
    """The engine observer that feeds ServiceMetrics (called on the engine thread)."""

    def __init__(self, metrics: ServiceMetrics, model_name: str) -> None:
        m, name = metrics, model_name
        self._prompt_tokens, self._generation_tokens = m.prompt_tokens.labels(name), m.generation_tokens.labels(name)
        self._prefix_queried, self._prefix_hits = m.prefix_queried.labels(name), m.prefix_hits.labels(name)
        self._preemptions = m.preemptions.labels(name)
        self._spec_draft, self._spec_accepted = m.spec_draft.labels(name), m.spec_accepted.labels(name)
        self._finished = {reason: m.finished.labels(name, reason) for reason in FINISH_REASONS}
        self._ttft, self._itl, self._e2e = m.ttft.labels(name), m.itl.labels(name), m.e2e.labels(name)
        self._queue, self._prefill = m.queue_time.labels(name), m.prefill_time.labels(name)
        self._decode = m.decode_time.labels(name)
        self._prompt_length, self._output_length = m.prompt_length.labels(name), m.output_length.labels(name)
        self._step_time = m.step_time
        self._batch_size = m.batch_size.labels(name)
        self._finished_family, self._name = m.finished, name
        m.rejected.labels(name)  # present (at 0) from the start, so that rate() sees the first one

    def scheduled(self, request: Request, now: float) -> None:
        self._queue.observe(now - request.times.queued)
        self._prefix_queried.inc(request.num_tokens)
        self._prefix_hits.inc(request.num_cached_tokens)

    def preempted(self, request: Request) -> None:
        self._preemptions.inc()

    def token(self, request: Request, now: float) -> None:
        times = request.times
        if times.first_token is None:
            self._ttft.observe(now - times.queued)
            if times.scheduled is not None:
                self._prefill.observe(now - times.scheduled)
            if request.index == 0:  # a prompt with n completions counts once, as usage does
                self._prompt_tokens.inc(request.num_prompt_tokens)
                self._prompt_length.observe(request.num_prompt_tokens)
        else:
            self._itl.observe(now - times.last_token)
        self._generation_tokens.inc()

    def finished(self, request: Request, reason: str, now: float) -> None:
        counter = self._finished.get(reason)
        if counter is None:  # a reason added after this list: counted all the same
            counter = self._finished[reason] = self._finished_family.labels(self._name, reason)
        counter.inc()
        times = request.times
        self._e2e.observe(now - times.queued)
        if times.first_token is not None and times.last_token is not None:
            self._decode.observe(times.last_token - times.first_token)
        self._output_length.observe(len(request.output_token_ids))
        self._spec_draft.inc(request.num_drafted_tokens)
        self._spec_accepted.inc(request.num_accepted_tokens)

    def step(self, batch_size: int, num_tokens: int, duration_s: float) -> None:
        self._step_time.labels(self._name, batch_size_label(batch_size)).observe(duration_s)
        self._batch_size.observe(batch_size)


@contextlib.contextmanager
def metrics_endpoint(registry: CollectorRegistry, host: str, port: int) -> Iterator[int | None]:
    """Expose `registry` at http://host:port/metrics (a daemon thread) while inside; yields the
    port, or None when `port` is 0 (off). Raises StartupError when the port is taken: a
    misconfigured pod should fail at start."""
    if not port:
        yield None
        return
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as error:
        raise StartupError(f"cannot serve metrics on {host}:{port}: {error.strerror or error}") from None
    log.info("metrics on http://%s:%d/metrics", host, server.server_port)
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
