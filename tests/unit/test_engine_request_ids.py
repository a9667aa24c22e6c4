"""Request ids: engine keys are the server's own; a client's id is a label that may repeat and can
never reach another request (tiny random-weight model, real engine, real gRPC server)."""
from __future__ import annotations

import asyncio
import time

import pytest

from forge_service import LLM, SamplingParams
from forge_service.engine.request import Request
from forge_service.engine.scheduler import Scheduler
from forge_service.errors import InvalidArgument
from forge_service.pb import forge_pb2 as pb
from tests.tiny_models import CHATML_TEMPLATE, tiny_arch, tiny_tokenizer_json, write_safetensors_dir
from tests.unit.test_engine_tiny import sharp_weights

pytestmark = pytest.mark.timeout(120)
PROMPT = list(range(5, 25))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    arch = tiny_arch()
    root = tmp_path_factory.mktemp("tiny-ids")
    write_safetensors_dir(root, arch, sharp_weights(arch), tokenizer_json=tiny_tokenizer_json(),
                          chat_template=CHATML_TEMPLATE)
    return root


def victim_params() -> SamplingParams:
    return SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=24, ignore_eos=True)


def drain(engine, tokens: dict[str, dict[int, list[int]]] | None = None,
          steps: int | None = None) -> dict[str, dict[int, list[int]]]:
    """Step until idle (or `steps` times), collecting each completion's tokens."""
    tokens = {} if tokens is None else tokens
    while engine.has_unfinished_requests() and (steps is None or steps > 0):
        steps = None if steps is None else steps - 1
        for delta in engine.step():
            for o in delta.outputs:
                tokens.setdefault(delta.request_id, {}).setdefault(o.index, []).extend(o.token_ids)
    return tokens


def test_a_completion_id_used_as_a_request_id_is_refused_and_harms_nothing(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32")
    alone = llm.generate([PROMPT], victim_params())[0]
    engine = llm.engine
    engine.add_request("X", PROMPT, victim_params())
    tokens = drain(engine, steps=2)
    stop = alone.outputs[0].text[2:4]
    for attacker in ("X#0", "X"):  # a completion's id, the parent's id: both in use
        with pytest.raises(InvalidArgument, match="already in use"):
            engine.add_request(attacker, PROMPT[:5], SamplingParams(stop=[stop], max_tokens=4))
    engine.add_request("Y", PROMPT, SamplingParams(n=2, max_tokens=3))  # Y#0, Y#1: no clash
    with pytest.raises(InvalidArgument, match="'Y#1' is already in use"):  # a parent whose completion id clashes
        engine.add_request("Y#1", PROMPT, SamplingParams(max_tokens=3))
    drain(engine, tokens)
    assert tokens["X"] == {0: alone.outputs[0].token_ids, 1: alone.outputs[1].token_ids}
    assert not engine.has_unfinished_requests() and not engine.processors
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert engine.kv.num_used_blocks == 0 or engine.kv.prefix_caching


def test_a_failed_add_leaves_nothing_behind(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32")
    engine = llm.engine
    engine.add_request("Z", PROMPT, SamplingParams(max_tokens=2))
    real_add = engine.scheduler.add

    def add_then_fail_second(request: Request) -> None:
        if request.index == 1:
            raise InvalidArgument("refused by the test")
        real_add(request)

    engine.scheduler.add = add_then_fail_second
    with pytest.raises(InvalidArgument, match="refused by the test"):
        engine.add_request("W", PROMPT, SamplingParams(n=2, max_tokens=2))
    engine.scheduler.add = real_add
    assert set(engine.parents) == {"Z"} and set(engine.processors) == {"Z"}
    assert engine.scheduler.get("W#0") is None
    drain(engine)
    assert not engine.has_unfinished_requests()


def test_scheduler_refuses_a_duplicate_id_with_an_error_not_an_assert():
    from forge_service.config import SchedulerConfig
    from forge_service.kv_cache.manager import KVCacheManager

    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_waiting=0),
                          KVCacheManager(16, 4))
    scheduler.add(Request("a", [1, 2, 3], SamplingParams()))
    with pytest.raises(InvalidArgument, match="'a' is already queued or running"):
        scheduler.add(Request("a", [4], SamplingParams()))
    assert scheduler.num_waiting == 1


def test_grpc_client_ids_are_labels_and_the_x0_attack_harms_nobody(tiny_dir):
    from tests.unit.test_server_fake_engine import run, text_request

    llm = LLM(model=str(tiny_dir), dtype="float32")
    alone = llm.generate([PROMPT], victim_params())[0]
    stop = alone.outputs[0].text[2:4]
    attacker_params = SamplingParams(temperature=0, max_tokens=6, stop=[stop], ignore_eos=True)
    attacker_alone = llm.generate([PROMPT[:7]], attacker_params)[0].outputs[0]
    engine = llm.engine
    steps, most_in_flight = [0], [0]
    real_step = engine.step

    def counting_step(on_launch=None):  # slowed down so that the attacker arrives while the victim runs
        steps[0] += 1
        most_in_flight[0] = max(most_in_flight[0], len(engine.parents))
        time.sleep(0.02)
        return real_step(on_launch)

    engine.step = counting_step
    victim_request = pb.GenerateRequest(
        request_id="X", token_ids=pb.TokenIds(ids=PROMPT), n=2,
        sampling=pb.SamplingParameters(temperature=1.0, seed=5),
        stopping=pb.StoppingParameters(max_tokens=24, ignore_eos=True))
    attacker_request = pb.GenerateRequest(
        request_id="X#0", token_ids=pb.TokenIds(ids=PROMPT[:7]), sampling=pb.SamplingParameters(temperature=0),
        stopping=pb.StoppingParameters(max_tokens=6, stop=[stop], ignore_eos=True))
    async def body(h):
        victim = h.stub.Stream(victim_request)
        first = await victim.read()
        attacker = await h.stub.Generate(attacker_request)  # while X's completions X#0, X#1 run
        same = await h.stub.Generate(attacker_request)  # a client id may repeat
        abandoned = h.stub.Stream(victim_request)  # the victim's own id again, then cancelled mid-way
        await abandoned.read()
        abandoned.cancel()
        texts = {0: "", 1: ""}
        message = first
        while message is not grpc_eof():
            if message.HasField("chunk"):
                texts[message.chunk.index] += message.chunk.text
            message = await victim.read()
        assert victim_request.request_id == first.request_id == "X"
        await until_idle(engine)
        idle_steps = steps[0]
        await asyncio.sleep(0.3)
        return attacker, same, texts, idle_steps

    attacker, same, texts, idle_steps = run(body, factory=lambda: engine)
    assert texts == {0: alone.outputs[0].text, 1: alone.outputs[1].text}  # the victim is untouched
    for response in (attacker, same):
        assert response.request_id == "X#0"  # the client's id is echoed as its label
        assert response.choices[0].text == attacker_alone.text
    assert most_in_flight[0] >= 2  # the attacker's request ran beside the victim's
    assert steps[0] == idle_steps  # the engine thread went idle: no step without work
    assert not engine.has_unfinished_requests() and not engine.parents


def grpc_eof():
    import grpc

    return grpc.aio.EOF


async def until_idle(engine) -> None:
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the engine never went idle")
