"""Hostile constraints: exploding regexes, deep or cyclic schemas, huge specs and slow compiles are
answered INVALID_ARGUMENT (or compiled into a grammar whose steps stay cheap) in well under a
second, and the server stays healthy.

Runs on the default model's real tokenizer (the GGUF vocabulary; no weights are loaded).
"""
from __future__ import annotations

import argparse
import json
import threading
import time

import grpc
import pytest

from forge_service.errors import InvalidArgument, QueueFull
from forge_service.pb import forge_pb2 as pb
from forge_service.structured import BACKENDS, Constraint, GrammarCompiler, GrammarMatcher, allocate_token_bitmask
from forge_service.structured import compiler as compiler_module
from tests.unit.fakes import FakeEngine
from tests.unit.test_server_fake_engine import code_of, run, text_request
from tests.unit.test_structured import EOS, ids, tok  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(120)
FAST_S = 1.0  # "well under a second" on this shared 2-core machine, with room for its noise


@pytest.fixture(scope="module")
def compiler(tok):  # noqa: F811
    c = GrammarCompiler(tok, 49152, EOS)
    c.compile(Constraint("regex", "a"))  # index the vocabulary once, outside every timing below
    yield c
    c.shutdown()


def _nested_objects(depth: int) -> str:
    return '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}' + '},"required":["a"]}' * depth


def _rule_chain(n: int) -> str:
    """A Lark grammar of n rules, each calling the next: the backend recurses once per rule."""
    return "start: x1\n" + "".join(f'x{i}: "b" x{i + 1}\n' for i in range(1, n)) + f'x{n}: "a"\n'


HOSTILE = [
    ("regex", "(a|b)*a(a|b){40}"),              # a DFA of 2^40 states
    ("regex", "[a-z]{1000000}"),
    ("regex", "((a{100}){100}){100}"),          # nested counters: a million-state automaton
    ("regex", "(a*)*b"),                         # catastrophic backtracking for a backtracking engine
    ("regex", "(x+x+)+y"),
    ("regex", "(.*a){200}"),
    ("json_schema", _nested_objects(200)),
    ("json_schema", _nested_objects(3000)),
    ("json_schema", json.dumps({"type": "string", "pattern": "(a|b)*a(a|b){40}"})),
    ("grammar", 'start: s\ns: s s | s s s | "a" | "aa"'),  # highly ambiguous
    ("grammar", 'root ::= "a"{1000000}'),
]


@pytest.mark.parametrize("kind, spec", HOSTILE, ids=[f"{k}:{s[:24]}" for k, s in HOSTILE])
def test_hostile_constraints_compile_or_are_refused_fast_and_steps_stay_cheap(compiler, tok, kind, spec):  # noqa: F811
    started = time.perf_counter()
    try:
        grammar = compiler.compile(Constraint(kind, spec))
    except InvalidArgument as e:
        assert time.perf_counter() - started < FAST_S and len(str(e)) < 2000
        return
    assert time.perf_counter() - started < FAST_S
    m, bitmask = GrammarMatcher(grammar), allocate_token_bitmask(1, 49152)
    for token in [ids(tok, "a")[0], ids(tok, "b")[0]] * 10:
        step = time.perf_counter()
        m.fill_mask(bitmask, 0)
        assert time.perf_counter() - step < 0.2  # a mask is computed on the engine's step
        if not m.accept_token(token):
            break


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
])
def test_schemas_that_recurse_without_content_are_refused(compiler, schema):
    """A $ref cycle compiles into a grammar that can never produce a token: refused up front, where it
    used to reach the engine as a matcher with no allowed token."""
    started = time.perf_counter()
    with pytest.raises(InvalidArgument, match="json_schema"):
        compiler.compile(Constraint("json_schema", json.dumps(schema)))
    assert time.perf_counter() - started < FAST_S


def test_a_deep_rule_chain_does_not_overflow_the_compile_threads_stack(compiler, tok):  # noqa: F811
    """~6,000 nested rules recurse deeper than a default 8 MB thread stack holds (the process died
    with SIGSEGV); compile threads get a larger one."""
    spec = _rule_chain(6000)
    assert len(spec) < compiler.max_spec_bytes
    try:
        grammar = compiler.compile(Constraint("grammar", spec))
    except InvalidArgument as e:
        assert "did not compile within" in str(e) or "limit" in str(e)
        return
    assert GrammarMatcher(grammar).accept_token(ids(tok, "b")[0])


def test_a_spec_over_the_size_limit_is_refused_without_compiling(tok):  # noqa: F811
    c = GrammarCompiler(tok, 49152, EOS, max_spec_bytes=1000)
    try:
        future = c.compile_async(Constraint("regex", "a" * 1001))
        assert future.done()  # refused at once: no thread, no vocabulary index
        with pytest.raises(InvalidArgument, match="1001 bytes; the limit is 1000"):
            future.result()
        assert c._backend is None and not c.cached(Constraint("regex", "a" * 1001))
    finally:
        c.shutdown()


class _SlowBackend:
    """Compiles 'slow' in `delay` seconds of waiting (no CPU time: as a compile waiting for a core
    does), 'wait S' in S seconds of it, 'busy S' in S seconds of work (CPU time), anything else at once."""

    delay = 3.0
    started = threading.Event()

    def __init__(self, tokenizer, vocab_size, eos_token_ids) -> None:
        pass

    def compile(self, constraint):
        if constraint.spec.startswith("slow"):
            self.started.set()
            time.sleep(self.delay)
        elif constraint.spec.startswith("wait "):
            time.sleep(float(constraint.spec.split()[1]))
        elif constraint.spec.startswith("busy "):
            end = time.thread_time() + float(constraint.spec.split()[1])
            while time.thread_time() < end:
                pass
        return object()


@pytest.fixture
def slow_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "slow", _SlowBackend)
    _SlowBackend.started.clear()
    return _SlowBackend


def test_a_compile_past_its_cpu_time_limit_is_invalid_argument(slow_backend):
    c = GrammarCompiler(None, 256, [0], backend="slow", compile_timeout_s=0.2)
    try:
        started = time.perf_counter()
        with pytest.raises(InvalidArgument, match=r"did not compile within 0.2 s of CPU time"):
            c.compile(Constraint("regex", "busy 3"))
        assert time.perf_counter() - started < 1.5  # 0.2 s of CPU, not the compile's 3
        assert not c.cached(Constraint("regex", "busy 3"))
        assert c.compile(Constraint("regex", "fast")) is not None  # the other thread still serves
    finally:
        c.shutdown()


def test_a_compile_waiting_for_a_core_is_not_charged_for_the_wait(slow_backend):
    """A compile held up past its limit by the server's load (here: a wait that uses no CPU) still
    compiles, where a wall-clock limit refused it."""
    c = GrammarCompiler(None, 256, [0], backend="slow", compile_timeout_s=0.2)
    try:
        assert c.compile(Constraint("regex", "wait 0.7")) is not None
        assert c.cached(Constraint("regex", "wait 0.7"))
    finally:
        c.shutdown()


def test_a_compile_waiting_past_ten_times_its_limit_is_resource_exhausted(slow_backend):
    c = GrammarCompiler(None, 256, [0], backend="slow", compile_timeout_s=0.1)
    try:
        started = time.perf_counter()
        with pytest.raises(QueueFull, match=r"waited 1(\.\d+)? s for a core .*the server is busy, retry later"):
            c.compile(Constraint("regex", "slow"))
        assert 1.0 <= time.perf_counter() - started < 2.5
        assert not c.cached(Constraint("regex", "slow"))
        assert c.compile(Constraint("regex", "fast")) is not None
    finally:
        c.shutdown()


def test_without_a_thread_cpu_clock_the_limit_is_wall_clock(slow_backend, monkeypatch):
    monkeypatch.setattr(compiler_module, "_thread_cpu_clock", lambda: None)
    c = GrammarCompiler(None, 256, [0], backend="slow", compile_timeout_s=0.2)
    try:
        started = time.perf_counter()
        with pytest.raises(InvalidArgument, match=r"did not compile within 0.2 s \(wall clock\)"):
            c.compile(Constraint("regex", "wait 3"))
        assert time.perf_counter() - started < 1.5
    finally:
        c.shutdown()


def test_compiles_waiting_for_a_thread_are_bounded(slow_backend):
    c = GrammarCompiler(None, 256, [0], backend="slow", compile_threads=1, max_queued=2)
    try:
        c.compile_async(Constraint("regex", "slow 0"))
        assert slow_backend.started.wait(5)  # the thread is busy; what follows queues
        queued = [c.compile_async(Constraint("regex", f"slow {i}")) for i in (1, 2)]
        with pytest.raises(QueueFull, match="waiting to compile"):
            c.compile_async(Constraint("regex", "slow 3")).result()
        assert not any(f.done() for f in queued)
    finally:
        c.shutdown()
    assert all(f.cancelled() for f in queued)  # shutdown never leaves a waiter hanging


class _GrammarFake(FakeEngine):
    """A fake engine with the real grammar compiler over the default model's tokenizer."""

    def __init__(self, compiler: GrammarCompiler) -> None:
        super().__init__()
        self.grammar_compiler = compiler


def test_the_server_answers_hostile_constraints_fast_and_stays_healthy(compiler):
    hostile = [{"regex": "((a{100}){100}){100}"}, {"json_schema": json.dumps({"$ref": "#"})},
               {"json_schema": _nested_objects(3000)}, {"regex": "(" * 5000 + "a" + ")" * 5000},
               {"grammar": "x" * (compiler.max_spec_bytes + 1)}]

    async def body(h):
        answers = []
        for fields in hostile:
            started = time.perf_counter()
            try:
                await h.stub.Generate(text_request("abc", max_tokens=2, **fields))
                answers.append((grpc.StatusCode.OK, time.perf_counter() - started))
            except grpc.aio.AioRpcError as e:
                answers.append((e.code(), time.perf_counter() - started, len(e.details())))
        health = await h.stub.Health(pb.HealthRequest())
        ok = await h.stub.Generate(text_request("xyz", max_tokens=2, regex="[a-z]+"))
        return answers, health, ok

    answers, health, ok = run(body, _GrammarFake(compiler))
    for answer in answers:
        assert answer[0] in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT) and answer[1] < FAST_S, answers
    assert [a[0] for a in answers[1:]] == [grpc.StatusCode.INVALID_ARGUMENT] * 4
    assert all(a[2] < 1000 for a in answers[1:])  # no error quotes a spec whole
    assert health.ready and ok.choices[0].text == "xy"


def test_the_server_answers_a_compile_starved_of_cpu_resource_exhausted(slow_backend):
    """RESOURCE_EXHAUSTED, marked queue_full (the gateway's 429, worth retrying): the server's load,
    not the constraint, held the compile up."""
    compiler = GrammarCompiler(None, 256, [0], backend="slow", compile_timeout_s=0.05)

    async def body(h):
        try:
            await h.stub.Generate(text_request("abc", max_tokens=2, regex="slow"))
        except grpc.aio.AioRpcError as e:
            return e.code(), dict(e.trailing_metadata() or ()), e.details()

    try:
        code, trailing, details = run(body, _GrammarFake(compiler))
    finally:
        compiler.shutdown()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry later" in details
    assert trailing.get("forge-error-kind") == "queue_full"


def test_flags_and_variables_set_the_grammar_limits():
    from forge_service.__main__ import add_arguments, configs_from_args
    from forge_service.config import StructuredConfig, engine_config_from_env
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--max-grammar-bytes", "1000", "--grammar-compile-timeout-s", "0.25"])
    assert configs_from_args(args)[0].structured == StructuredConfig(1000, 0.25)
    env = {"FORGE_MAX_GRAMMAR_BYTES": "7", "FORGE_GRAMMAR_COMPILE_TIMEOUT_S": "2"}
    assert engine_config_from_env(env).structured == StructuredConfig(7, 2.0)
    assert engine_config_from_env({}).structured == StructuredConfig(128 * 1024, 0.5)
