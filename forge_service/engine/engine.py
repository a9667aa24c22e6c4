"""The synchronous engine: requests in, one batched step at a time, delta outputs out."""
from __future__ import annotations

import ctypes
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from forge_service.backends import create_backend
from forge_service.config import EngineConfig
from forge_service.engine.observer import EngineObserver, NullObserver
from forge_service.engine.output_processor import CompletionProcessor, TokenTexts
from forge_service.engine.output_types import CompletionOutput, RequestOutput
from forge_service.engine.request import Request, RequestStatus, SamplingParams
from forge_service.engine.outputs import ScheduledChunk, SchedulerOutput
from forge_service.engine.scheduler import Scheduler
from forge_service.errors import CONTEXT_LENGTH_EXCEEDED, InvalidArgument, QueueFull, Unsupported
from forge_service import lora
from forge_service.kv_cache.block_hash import ROOT, chain_root
from forge_service.kv_cache.manager import KVCacheManager
from forge_service.loaders import Checkpoint, default_model_path, load_checkpoint
from forge_service.models.registry import build_model
from forge_service.runner.model_runner import ModelRunner, SampledToken
from forge_service.sampling.bad_words import bad_word_ids
from forge_service.structured import GrammarCompiler, MatcherSet
from forge_service.sampling.model_defaults import model_sampling_defaults
from forge_service.tokenizer import Tokenizer
from forge_service.tokenizer.chat_template import read_chat_template

log = logging.getLogger("forge.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Measured on the CPU this project targets (see bench/throughput.py): bf16 matmuls are faster.
AUTO_DTYPE = {"cpu": torch.bfloat16, "cuda": torch.bfloat16}


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return AUTO_DTYPE[device]
    if name not in DTYPES:
        raise InvalidArgument(f"dtype must be one of auto, {', '.join(DTYPES)}; got {name!r}")
    return DTYPES[name]


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    # drafting's cost model: a decode step's fixed cost in rows' worth (0: not drafting)
    spec_step_base_rows: float = 0.0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / max(1, self.kv_blocks_total)


@dataclass
class _Parent:
    """A prompt with its n completions (children)."""

    request_id: str
    prompt_token_ids: list[int]
    children: list[str]
    finished: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class _Limits:
    """What a request's bad_words and allowed_token_ids become once, for all its completions."""

    bad_words: tuple[tuple[int, ...], ...]
    allowed: torch.Tensor | None  # distinct ids, long

    @classmethod
    def of(cls, tokenizer: Tokenizer, params: SamplingParams) -> _Limits:
        allowed = params.allowed_token_ids
        return cls(bad_word_ids(tokenizer, params.bad_words),
                   None if allowed is None else torch.tensor(sorted(set(allowed)), dtype=torch.long))


def _return_freed_memory() -> None:
    """Give the allocator's free memory back to the OS. glibc keeps most freed heap memory (here:
    a model load's dense copies, a few hundred MB) mapped, where it counts as resident."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class LLMEngine:
    """Synchronous and single-threaded: only one thread may call it."""

    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None,
                 tokenizer: Tokenizer | None = None) -> None:
        """`checkpoint` and `tokenizer` replace loading them from the model path (benchmarks
        build random-weight models in memory)."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        path = config.model.model or (checkpoint.path if checkpoint else default_model_path())
        # Read before the weights load: a template that cannot serve fails the start at once.
        template = read_chat_template(config.model.chat_template) if config.model.chat_template else None
        backend = create_backend(config.model.device)  # raises first if the device cannot be used
        self.dtype = resolve_dtype(config.model.dtype, config.model.device)
        started = time.perf_counter()
        # The 4- and 8-bit codes feed CPU kernels; other devices multiply by the dequantised weights.
        # On the CPU a projection with codes is decoded only if its kernels cannot serve the codes.
        on_cpu = backend.device.type == "cpu"
        ckpt = checkpoint or load_checkpoint(path, self.dtype, lazy_coded=on_cpu)
        self.tokenizer = tokenizer or Tokenizer.from_path(path)
        if template is not None:
            self.tokenizer.set_chat_template(template)
        self.arch = ckpt.arch
        weights = {name: w if w.is_meta else w.to(backend.device) for name, w in ckpt.weights.items()}
        codes = {**ckpt.int4, **ckpt.int8} if on_cpu else None
        self.model = build_model(path, ckpt.arch, weights, backend, codes, ckpt.decoders)
        # The model keeps what its kernels read; the loader's dense copies and codes go back to the OS.
        del ckpt, weights, codes
        _return_freed_memory()
        self.max_model_len = min(config.model.max_model_len or self.arch.max_position_embeddings,
                                 self.arch.max_position_embeddings)
        self.runner = ModelRunner(self.model, self.arch, config.cache, self.dtype)
        self.runner.startup(config.scheduler.max_num_seqs, self.max_model_len)
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        plan = getattr(self.model, "decode_plan", None)  # the fused decode's row bound and block, where there is one
        self.scheduler = Scheduler(config.scheduler, self.kv, config.speculative, getattr(plan, "max_rows", None),
                                   getattr(plan, "row_block", 1))
        self.model_name = config.model.served_model_name or _name_from_path(path)
        # What a served request leaves unset of these sampling fields; {}: Forge's defaults.
        self.sampling_defaults = model_sampling_defaults(path) if config.model.generation_config == "auto" else {}
        if self.sampling_defaults:
            log.info("sampling defaults from the model's files (for fields a request leaves unset): %s",
                     ", ".join(f"{k}={v}" for k, v in self.sampling_defaults.items()))
        self.adapters = self._load_adapters(config, backend)  # LoRA adapter name -> 1-based index
        self.eos_token_ids = tuple(self.arch.eos_token_ids or self.tokenizer.eos_token_ids)
        # Structured output: masks are as wide as the logits; the backend is built on first compile.
        self.grammar_compiler = GrammarCompiler(
            self.tokenizer.backend, self.arch.vocab_size, self.eos_token_ids,
            max_spec_bytes=config.structured.max_grammar_bytes,
            compile_timeout_s=config.structured.grammar_compile_timeout_s)
        self.runner.grammars = MatcherSet(self.grammar_compiler)
        self.token_texts = TokenTexts(self.tokenizer)
        self.processors: dict[str, CompletionProcessor] = {}
        self.parents: dict[str, _Parent] = {}
        self.num_preemptions = 0
        # Told what happens to each request (the service sets its metrics here).
        self.observer: EngineObserver = NullObserver()
        log.info("loaded %s (%s) in %.1fs: %d KV blocks of %d tokens", path, self.dtype,
                 time.perf_counter() - started, self.runner.num_blocks, config.cache.block_size)

    def _load_adapters(self, config: EngineConfig, backend) -> dict[str, int]:
        paths = config.model.lora_paths()
        if paths and backend.device.type != "cpu":
            raise ValueError("LoRA adapters (--lora-modules) are served on the CPU backend only")
        for name, path in paths.items():
            if name == self.model_name:
                raise ValueError(f"lora_modules: adapter name {name!r} is the served model's own name")
            adapter = lora.load_adapter(name, path, self.arch, config.model.max_lora_rank)
            self.model.add_adapter(adapter)
            log.info("LoRA adapter %s from %s: rank %d, %d modules", name, path, adapter.rank, adapter.num_modules)
        return {name: i + 1 for i, name in enumerate(paths)}

    # ---- requests in ----
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    label: str | None = None) -> None:
        """Validate and queue a prompt; raises InvalidArgument or QueueFull and then leaves nothing behind.

        `request_id` is the engine's key and must not be in use (the server makes a fresh one per
        request); with n > 1, completion i runs as `<request_id>#<i>`. `label` is the client's id,
        for logs and traces only (default: request_id)."""
        self.validate(prompt_token_ids, params)
        bound = self.config.scheduler.max_waiting
        if bound and self.scheduler.num_waiting + params.n > bound:
            raise QueueFull(f"the waiting queue is full ({self.scheduler.num_waiting} of {bound})")
        label = request_id if label is None else label
        limits = _Limits.of(self.tokenizer, params)
        children = [self._child(request_id, prompt_token_ids, params, i, label, limits) for i in range(params.n)]
        taken = next((i for i in [request_id, *(c.request_id for c in children)]
                      if i in self.parents or i in self.processors), None)
        if taken is not None:  # a parent's id and another's completion id must never meet either
            raise InvalidArgument(f"request id {taken!r} is already in use")
        # A cache hit when the servicer compiled it off the loop first; offline, compiled here.
        grammar = None if params.constraint is None else self.grammar_compiler.compile(params.constraint)
        self.parents[request_id] = _Parent(request_id, list(prompt_token_ids), [c.request_id for c in children])
        try:
            for child in children:
                self.processors[child.request_id] = CompletionProcessor(self.tokenizer, child, self.token_texts, grammar)
                if grammar is not None:  # each completion its own matcher
                    self.runner.grammars.add(child.request_id, grammar)
                self.scheduler.add(child)
        except BaseException:
            self.abort_request(request_id)  # all or nothing: no half-added request lingers
            raise

    def _child(self, request_id: str, prompt: list[int], params: SamplingParams, index: int,
               label: str, limits: _Limits) -> Request:
        return Request(
            request_id=request_id if params.n == 1 else f"{request_id}#{index}",
            prompt_token_ids=list(prompt), sampling_params=params, stop_token_set=self._stop_tokens(params),
            bad_word_ids=limits.bad_words, allowed_token_index=limits.allowed,
            max_model_len=self.max_model_len, parent_id=request_id, index=index, label=label,
            seed=None if params.seed is None else params.seed + index,
            adapter=self.adapters.get(params.adapter, 0),
            cache_root=chain_root(params.adapter.encode()) if params.adapter else ROOT,
            # The prompt is the same for every completion: the first computes its logprobs.
            prompt_logprobs={} if params.prompt_logprobs is not None and index == 0 else None,
        )

    def _stop_tokens(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a completion: stop_token_ids, and EOS unless ignored."""
        stops = set(params.stop_token_ids)
        if not params.ignore_eos or params.constraint is not None:  # a grammar allows EOS only at its end
            stops.update(self.eos_token_ids)
        return frozenset(stops)

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise InvalidArgument for bad parameters or a request that cannot fit; thread-safe
        (reads only state fixed at load time)."""
        params.validate(self.arch.vocab_size)
        if params.adapter is not None and params.adapter not in self.adapters:
            loaded = ", ".join(map(repr, self.adapters)) or "none"
            raise InvalidArgument(f"LoRA adapter {params.adapter!r} is not loaded here (loaded: {loaded})",
                                  field="adapter")
        if params.priority and self.config.scheduler.scheduling_policy != "priority":
            raise InvalidArgument(f"priority {params.priority} needs the server's priority scheduling "
                                  "(--scheduling-policy priority); this one serves requests in arrival order",
                                  field="priority")
        allowed = set(params.allowed_token_ids or ())
        if params.min_tokens and allowed and not allowed - self._stop_tokens(params):
            raise InvalidArgument("allowed_token_ids has only stop tokens, which min_tokens holds back: nothing could "
                                  "be generated", field="allowed_token_ids")
        if params.constraint is not None and set(params.stop_token_ids) - set(self.eos_token_ids):
            raise InvalidArgument("stop_token_ids cannot be combined with structured output: a stop token could "
                                  "cut the output short of its grammar (stop strings end it only where it is complete)",
                                  field="stop_token_ids")
        if params.embed and self.arch.pooling not in (None, "last"):
            raise Unsupported(f"this model declares {self.arch.pooling} pooling; Forge embeds by the last token only",
                              field="embed")
        if not prompt:
            raise InvalidArgument("the prompt is empty: it needs at least one token")
        bad = [t for t in prompt if not 0 <= t < self.arch.vocab_size]
        if bad:
            raise InvalidArgument(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.arch.vocab_size})")
        n, limit = len(prompt), self.max_model_len
        wanted = n + (params.max_tokens or 1)
        if wanted > limit:
            raise InvalidArgument(
                f"the prompt has {n} tokens and max_tokens is {params.max_tokens}: {wanted} tokens exceed "
                f"the model's context length of {limit} by {wanted - limit}", kind=CONTEXT_LENGTH_EXCEEDED)
        capacity = self.kv.block_size * self.runner.num_blocks
        if wanted > capacity:
            raise InvalidArgument(
                f"the prompt has {n} tokens and max_tokens is {params.max_tokens}: {wanted} tokens exceed "
                f"the KV cache's capacity of {capacity} tokens by {wanted - capacity}", kind=CONTEXT_LENGTH_EXCEEDED)

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        """End a request early; `reason` ("abort", or "error" when the engine failed) is what
        the observer is told."""
        parent = self.parents.pop(request_id, None)
        now = time.monotonic()
        for child_id in parent.children if parent else []:
            child = self.scheduler.finish(child_id, RequestStatus.FINISHED_ABORTED)
            if child is not None:
                child.times.finished = now
                self.observer.finished(child, reason, now)
            self._forget(child_id)

    # ---- one step ----
    def step(self, on_launch: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Schedule, run the model once, sample; returns deltas of the requests that progressed.
        `on_launch` is called as the model run starts, its inputs built (again for each retry
        below: it must be idempotent).

        A request whose admission, model run or output processing raises fails alone (finish
        reason "error", `RequestOutput.error` set, with its n siblings aborted); the others go on
        with exactly the tokens they would have had without it."""
        started = time.monotonic()
        out = self.scheduler.schedule()
        deltas: dict[str, RequestOutput] = {}
        dropped = {request.request_id: request for request, _ in out.failed}  # the scheduler let go of them
        for request, error in out.failed:
            self._fail(request, error, deltas, dropped)
        if out.empty:
            self._fail_orphans(deltas)
            return list(deltas.values())
        self.num_preemptions += len(out.preempted)
        self._observe_scheduled(out, started)
        sampled = self._execute(out, deltas, on_launch)
        now = time.monotonic()
        for chunk in out.chunks:
            run = sampled.get(chunk.request.request_id)
            try:
                got = self.scheduler.advance(chunk, None if run is None else [s.token_id for s in run])
                if got:
                    self._emit_run(chunk.request, run[:got], deltas, now)
            except Exception as error:  # this request's output processing: it fails alone
                self._fail(chunk.request, error, deltas)
        elapsed = time.monotonic() - started
        self.scheduler.observe(out, elapsed)
        self.observer.step(len(out.chunks), out.num_tokens, elapsed)
        return list(deltas.values())

    def _observe_scheduled(self, out: SchedulerOutput, now: float) -> None:
        for request in out.preempted:
            self.observer.preempted(request)
        for chunk in out.chunks:
            if chunk.request.times.scheduled is None:
                self.observer.scheduled(chunk.request, now)
                chunk.request.times.scheduled = now

    def _execute(self, out: SchedulerOutput, deltas: dict[str, RequestOutput],
                 on_launch: Callable[[], None] | None) -> dict[str, list[SampledToken]]:
        """Run the step's batch. If it raises, retry without the newest admissions, then in halves,
        until each failure is pinned to one request; only those fail. A failed run leaves no
        request's state advanced (the runner restores grammar matchers, seeded noise has no state;
        the KV it wrote lies in slots that are not yet counted as computed)."""
        sampled: dict[str, list[SampledToken]] = {}
        old = len(out.chunks) - out.num_admitted
        split = old if 0 < old < len(out.chunks) else len(out.chunks) // 2
        for chunk, error in self._run_isolating(out.chunks, split, sampled, on_launch):
            self._fail(chunk.request, error, deltas)
        return sampled

    def _run_isolating(self, chunks: list[ScheduledChunk], split: int, sampled: dict[str, list[SampledToken]],
                       on_launch: Callable[[], None] | None) -> list[tuple[ScheduledChunk, Exception]]:
        try:
            tokens = self.runner.execute(SchedulerOutput(chunks=chunks), on_launch)
        except Exception as error:
            if len(chunks) == 1:
                return [(chunks[0], error)]
            log.warning("a step over %d requests failed (%s: %s); retrying in parts to find the cause",
                        len(chunks), type(error).__name__, error)
        else:
            for s in tokens:
                sampled.setdefault(s.request_id, []).append(s)
            return []
        return (self._run_isolating(chunks[:split], len(chunks[:split]) // 2, sampled, on_launch)
                + self._run_isolating(chunks[split:], len(chunks[split:]) // 2, sampled, on_launch))

    def _fail(self, request: Request, error: BaseException, deltas: dict[str, RequestOutput],
              dropped: dict[str, Request] | None = None) -> None:
        """End a failed request's whole prompt: the failed completion with "error", its siblings aborted."""
        error_id = uuid.uuid4().hex[:12]
        log.error("request %s (engine id %s) failed; stopped alone, the others go on [error id %s]",
                  request.label, request.request_id, error_id, exc_info=error, extra={"request_id": request.label})
        parent = self.parents.pop(request.parent_id, None)
        if parent is None:  # already ended
            return
        self._end_parent(parent, request.request_id, deltas,
                         f"internal engine error while computing this request; it was stopped and the "
                         f"other requests went on [error id {error_id}]",
                         {request.request_id: request, **(dropped or {})})

    def _end_parent(self, parent: _Parent, failed_id: str | None, deltas: dict[str, RequestOutput],
                    message: str, dropped: dict[str, Request] | None = None) -> None:
        out = deltas.setdefault(parent.request_id, RequestOutput(parent.request_id, parent.prompt_token_ids, []))
        out.finished, out.error = True, message
        now = time.monotonic()
        for index, child_id in enumerate(parent.children):
            if child_id in parent.finished:
                continue
            failed = failed_id is None or child_id == failed_id  # None: all of them
            status = RequestStatus.FINISHED_ERROR if failed else RequestStatus.FINISHED_ABORTED
            # Those whose admission failed are out of the scheduler already, but end here all the same.
            child = self.scheduler.finish(child_id, status) or (dropped or {}).get(child_id)
            if child is not None:
                child.times.finished = now
                self.observer.finished(child, status.finish_reason, now)
            self._forget(child_id)
            out.outputs.append(CompletionOutput(index=index, finish_reason=status.finish_reason))

    def _fail_orphans(self, deltas: dict[str, RequestOutput]) -> None:
        """Nothing is left to schedule, so any request still open is a bug's leftover: end it with
        an error rather than keep the engine busy forever."""
        if self.scheduler.has_unfinished or not self.parents:
            return
        error_id = uuid.uuid4().hex[:12]
        log.error("%d requests had nothing left to compute; failing them [error id %s]",
                  len(self.parents), error_id)
        for parent_id in list(self.parents):
            parent = self.parents.pop(parent_id)
            self._end_parent(parent, None, deltas, f"internal engine error: the request was lost [error id {error_id}]")

    def _emit_run(self, request: Request, run: list[SampledToken], deltas: dict[str, RequestOutput],
                  now: float) -> None:
        """Emit the tokens a request got this step (several after an accepted draft) as one delta.

        Tokens go through output processing one by one, the request shown running before its
        last, so a stop string inside the run ends the output at its exact token; the tokens
        after it are dropped from the request too."""
        final = request.status, request.stop_reason
        parent_id = request.parent_id
        before = len(deltas[parent_id].outputs) if parent_id in deltas else 0
        for i, s in enumerate(run):
            last = i == len(run) - 1
            request.status, request.stop_reason = final if last else (RequestStatus.RUNNING, None)
            self._emit(request, s, deltas, now)
            if not last and (request.status.finished or request.request_id not in self.processors):
                if not request.status.finished:  # aborted meanwhile: it ends as the abort left it
                    request.status, request.stop_reason = final
                del request.output_token_ids[len(request.output_token_ids) - (len(run) - 1 - i):]
                break
        if parent_id in deltas:
            _merge_deltas(deltas[parent_id].outputs, before)

    def _emit(self, request: Request, s, deltas: dict[str, RequestOutput], now: float) -> None:
        processor = self.processors.get(request.request_id)
        parent = self.parents.get(request.parent_id)
        if processor is None or parent is None:  # aborted between schedule and now
            return
        # The prompt is computed whole by its first token; its logprobs go out once, with it (a
        # recompute after preemption then skips them).
        prompt_logprobs = None if request.prompt_logprobs is None else self.token_texts.prompt(request)
        request.prompt_logprobs = None
        if s.refused:  # outside its grammar: neither passed off as complete nor continued unconstrained
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_ABORTED)
            request.status, request.stop_reason = RequestStatus.FINISHED_ABORTED, None
        delta, matched = processor.process(request, s)
        delta.num_drafted_tokens, delta.num_accepted_tokens = request.num_drafted_tokens, request.num_accepted_tokens
        self._observe_token(request, now)
        if matched is not None:
            self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED)
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, matched
        if request.status.finished:
            delta.finish_reason, delta.stop_reason = request.status.finish_reason, request.stop_reason
            request.times.finished = now
            self.observer.finished(request, request.status.finish_reason, now)
            delta.times = request.times
            parent.finished.add(request.request_id)
            self._forget(request.request_id)
        out = deltas.setdefault(parent.request_id, RequestOutput(parent.request_id, parent.prompt_token_ids, []))
        out.num_cached_tokens = max(out.num_cached_tokens, request.num_cached_tokens)
        out.prompt_logprobs = out.prompt_logprobs or prompt_logprobs
        out.outputs.append(delta)
        if len(parent.finished) == len(parent.children):
            out.finished = True
            del self.parents[parent.request_id]

    def _observe_token(self, request: Request, now: float) -> None:
        self.observer.token(request, now)
        if request.times.first_token is None:
            request.times.first_token = now
        request.times.last_token = now

    def _forget(self, child_id: str) -> None:
        self.processors.pop(child_id, None)
        self.runner.release(child_id)

    # ---- state ----
    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def stats(self) -> EngineStats:
        return EngineStats(self.scheduler.num_running, self.scheduler.num_waiting,
                           self.kv.num_used_blocks, self.runner.num_blocks,
                           self.scheduler.step_base_rows)


def _merge_deltas(outputs: list[CompletionOutput], start: int) -> None:
    """Fold outputs[start:] (one completion's deltas of one step, in order) into one."""
    for delta in outputs[start + 1:]:
        outputs[start].extend(delta)
    del outputs[start + 1:]


def _name_from_path(path: str) -> str:
    import os

    base = os.path.basename(os.path.normpath(path))
    return base[:-5] if base.endswith(".gguf") else base
