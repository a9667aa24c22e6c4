"""A fake LLMEngine for service tests: byte-level tokenizer, echoes the prompt back.

It mirrors the interface of forge_service.engine.engine.LLMEngine (add_request, abort_request,
step, has_unfinished_requests, stats, tokenizer, model_name, max_model_len) and returns its output
types, so the async engine and the gRPC servicer can be tested without a model.
"""
from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Callable

import httpx

from forge_service.config import ServiceConfig
from forge_service.engine.output_types import CompletionOutput, Logprob, RequestOutput
from forge_service.engine.request import SamplingParams
from forge_service.errors import InvalidArgument, QueueFull
from forge_service.metrics import metrics_endpoint
from forge_service.serve import run_all_async
from forge_service.server import ForgeService
from tests.ports import free_port

EOS = 0


@dataclass
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 100
    kv_usage: float = 0.0
    spec_step_base_rows: float = 0.0


class FakeTokenizer:
    """One token per byte; id 0 is EOS."""

    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    continue_final_message: bool = False) -> list[int]:
        """`<role>content` per message, `</role>` after each but a continued last one."""
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        if continue_final_message:
            text = text[:-len(f"</{messages[-1]['role']}>")]
        return self.encode(text + ("<assistant>" if add_generation_prompt else ""))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")

    def id_to_token(self, token_id: int) -> str:
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id])


@dataclass
class FakeArch:
    hidden_size: int = 4  # the length of the fake's embeddings


@dataclass
class _Seq:
    index: int
    output: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _FakeRequest:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seqs: list[_Seq]
    running: bool = False


class FakeEngine:
    """Generates each completion as the prompt echoed back, one token per step.

    Completion i starts at prompt offset i. It stops on a stop token id, a stop string, EOS
    (unless ignore_eos) or max_tokens (default: the prompt's length).
    Knobs: step_delay_s (slow steps), max_running (others wait), fail_steps (step raises),
    block_adds (add_request raises QueueFull), gate (when set to an Event, step() waits for it).
    """

    def __init__(self, max_model_len: int = 128, step_delay_s: float = 0.0, max_running: int = 64,
                 model_name: str = "fake-model") -> None:
        self.tokenizer = FakeTokenizer()
        self.arch = FakeArch()
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.step_delay_s = step_delay_s
        self.max_running = max_running
        self.fail_steps = 0
        self.block_adds = False
        self.requests: dict[str, _FakeRequest] = {}
        self.added: list[str] = []
        self.labels: dict[str, str] = {}  # engine id -> the client's label
        self.aborted: list[str] = []
        self.steps = 0
        self.thread_ids: set[int] = set()
        self.stepped = threading.Event()
        self.gate: threading.Event | None = None

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate(self.tokenizer.vocab_size)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    label: str | None = None) -> None:
        self.thread_ids.add(threading.get_ident())
        self.labels[request_id] = request_id if label is None else label
        if self.block_adds:
            raise QueueFull("fake engine queue is full")
        params.validate(self.tokenizer.vocab_size)
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidArgument(f"prompt has {len(prompt_token_ids)} tokens; the context length is "
                                  f"{self.max_model_len}")
        seqs = [_Seq(i) for i in range(params.n)]
        self.requests[request_id] = _FakeRequest(request_id, list(prompt_token_ids), params, seqs)
        self.added.append(request_id)

    def abort_request(self, request_id: str, reason: str = "abort") -> None:
        self.thread_ids.add(threading.get_ident())
        if self.requests.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> EngineStats:
        running = sum(r.running for r in self.requests.values())
        return EngineStats(num_running=running, num_waiting=len(self.requests) - running,
                           kv_blocks_used=running * 2, kv_usage=running * 2 / 100)

    def step(self, on_launch: Callable[[], None] | None = None) -> list[RequestOutput]:
        self.thread_ids.add(threading.get_ident())
        self.steps += 1
        self.stepped.set()
        if on_launch is not None:
            on_launch()  # the model run starts: the gate and the delay below stand for it
        if self.gate is not None:
            self.gate.wait(10)
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("fake step failure")
        for request in list(self.requests.values())[: self.max_running]:
            request.running = True
        outputs = [self._advance(r) for r in list(self.requests.values()) if r.running]
        for output in outputs:
            if output.finished:
                del self.requests[output.request_id]
        return outputs

    def _advance(self, request: _FakeRequest) -> RequestOutput:
        deltas = [self._advance_seq(request, seq) for seq in request.seqs if seq.finish_reason is None]
        finished = all(seq.finish_reason is not None for seq in request.seqs)
        return RequestOutput(request.request_id, request.prompt, deltas, finished, num_cached_tokens=0)

    def _advance_seq(self, request: _FakeRequest, seq: _Seq) -> CompletionOutput:
        params = request.params
        token = request.prompt[(seq.index + len(seq.output)) % len(request.prompt)]
        seq.output.append(token)
        limit = params.max_tokens or len(request.prompt)
        text = self.tokenizer.decode([token])
        if token in params.stop_token_ids or (token == EOS and not params.ignore_eos):
            seq.finish_reason, seq.stop_reason, text = "stop", token, ""
        else:
            before = len(seq.text)
            seq.text += text
            for stop in params.stop:
                at = seq.text.find(stop)
                if at >= 0:
                    keep = at + (len(stop) if params.include_stop_str_in_output else 0)
                    seq.text = seq.text[:keep]
                    text = seq.text[before:]
                    seq.finish_reason, seq.stop_reason = "stop", stop
                    break
        if seq.finish_reason is None and len(seq.output) >= limit:
            seq.finish_reason = "length"
        logprobs = None
        if params.logprobs is not None:
            alternatives = [Logprob(t, -1.0 - r, r + 2, chr(t)) for r, t in enumerate(range(65, 65 + params.logprobs))]
            logprobs = [[Logprob(token, -0.5, 1, self.tokenizer.id_to_token(token)), *alternatives]]
        # an embedding: the prompt's length and its first token, then 3 and 4 (a hidden size of 4)
        embedding = [float(len(request.prompt)), float(request.prompt[0]), 3.0, 4.0] if params.embed else None
        return CompletionOutput(seq.index, text, [token], logprobs, finish_reason=seq.finish_reason,
                                stop_reason=seq.stop_reason, embedding=embedding)


# ---- waiting helpers shared by the serving tests ------------------------------------------

def wait_ready(url: str) -> None:
    """Poll the gateway's /health until it answers 200 (10 s at most)."""
    deadline = time.monotonic() + 10
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.ConnectError:
            pass
        assert time.monotonic() < deadline, "never ready"
        time.sleep(0.02)


async def until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def forge_serve_fake(**engine_options: object) -> Iterator[ServiceConfig]:
    """The service and the gateway on a FakeEngine in one process, as `forge serve` runs them (its
    metrics endpoint included), on a thread of their own; yields the config, ports filled in."""
    config = ServiceConfig(host="127.0.0.1", grpc_port=0, http_port=free_port(), metrics_port=free_port(),
                           drain_timeout_s=1)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    service = ForgeService(config, lambda: FakeEngine(**engine_options))
    thread = threading.Thread(target=loop.run_until_complete, args=(run_all_async(service, config, stop),))
    with metrics_endpoint(service.metrics.registry, config.host, config.metrics_port):
        thread.start()
        try:
            wait_ready(f"http://127.0.0.1:{config.http_port}")
            yield config
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(20)
            loop.close()
