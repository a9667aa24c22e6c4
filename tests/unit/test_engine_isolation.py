"""Fault isolation: a request that makes the engine raise fails alone, and every other request
finishes with exactly the tokens it would have had without it (tiny random-weight model, fp32)."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from forge_service import LLM, SamplingParams
from forge_service.engine.request import RequestStatus
from forge_service.pb import forge_pb2 as pb
from forge_service.structured import Constraint
from tests.tiny_models import CHATML_TEMPLATE, random_weights, tiny_arch, tiny_tokenizer_json, write_safetensors_dir
from tests.unit.test_engine_request_ids import drain

pytestmark = pytest.mark.timeout(120)
POISON_SEED = 1_000_000
REGEX = Constraint("regex", r"[a-c]{2,6}(-[0-9]{1,3}){1,2}")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    arch = tiny_arch()
    root = tmp_path_factory.mktemp("tiny-isolation")
    # Plain random weights: sampling at temperature 1 really depends on each generator's state.
    write_safetensors_dir(root, arch, random_weights(arch, seed=5), tokenizer_json=tiny_tokenizer_json(),
                          chat_template=CHATML_TEMPLATE)
    return root


VICTIMS = {
    "seeded": (list(range(5, 30)), SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True)),
    "greedy": (list(range(40, 52)), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)),
    "grammar": (list(range(60, 80)), SamplingParams(temperature=1.0, seed=2, max_tokens=16, constraint=REGEX)),
    "pair": (list(range(90, 101)), SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)),
}


def new_engine(tiny_dir):
    return LLM(model=str(tiny_dir), dtype="float32").engine


def run_victims(engine, poison=None, after_steps: int = 2):
    for rid, (prompt, params) in VICTIMS.items():
        engine.add_request(rid, prompt, params)
    tokens = drain(engine, steps=after_steps)  # the batch is running when the poison comes
    errors = {}
    if poison is not None:
        poison(engine)
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.error:
                errors[delta.request_id] = (delta.error, sorted((o.index, o.finish_reason) for o in delta.outputs if o.finished))
            for o in delta.outputs:
                tokens.setdefault(delta.request_id, {}).setdefault(o.index, []).extend(o.token_ids)
    return tokens, errors


def add_poison(engine, constraint=None):
    engine.add_request("poison", list(range(100, 118)),
                       SamplingParams(n=2, temperature=1.0, seed=POISON_SEED, max_tokens=8, ignore_eos=True,
                                      constraint=constraint), label="the-poison")


def raise_in_model(engine):
    real = engine.runner.execute

    def execute(out, on_launch=None):
        if any(c.request.label == "the-poison" for c in out.chunks):
            raise RuntimeError("poisoned batch")
        return real(out, on_launch)
    engine.runner.execute = execute
    add_poison(engine)


def raise_after_sampling(engine):  # the sampler has already drawn from every seeded generator
    real = engine.runner.sampler

    def sampler(logits, meta):
        result = real(logits, meta)
        if any(s is not None and s >= POISON_SEED for s in meta.seeds):
            raise RuntimeError("poisoned sampler")
        return result
    engine.runner.sampler = sampler
    add_poison(engine)


def raise_after_grammar(engine):  # every constrained row's matcher has already accepted its token
    grammars = engine.runner.grammars
    real = grammars.accept

    def accept(request_ids, token_ids):
        refused = real(request_ids, token_ids)
        if any(r.startswith("poison") for r in request_ids):
            raise RuntimeError("poisoned grammar")
        return refused
    grammars.accept = accept
    add_poison(engine, constraint=REGEX)


def raise_in_admission(engine):  # like the RecursionError a long prefix-cache hit once raised
    real = engine.kv.match_prefix

    def match_prefix(request_id, token_ids):
        if request_id.startswith("poison"):
            raise RecursionError("maximum recursion depth exceeded in comparison")
        return real(request_id, token_ids)
    engine.kv.match_prefix = match_prefix
    add_poison(engine)


def raise_in_output(engine):
    add_poison(engine)

    def process(request, sampled):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "poisoned detokenizer")
    engine.processors["poison#1"].process = process


@pytest.mark.parametrize("poison", [raise_in_model, raise_after_sampling, raise_after_grammar, raise_in_admission,
                                    raise_in_output])
def test_a_poisoned_request_fails_alone_and_the_others_keep_their_exact_tokens(tiny_dir, poison):
    clean, clean_errors = run_victims(new_engine(tiny_dir))
    assert not clean_errors and set(clean) == set(VICTIMS)
    engine = new_engine(tiny_dir)
    tokens, errors = run_victims(engine, poison)
    assert {rid: tokens[rid] for rid in VICTIMS} == clean
    message, finishes = errors.pop("poison")
    assert not errors
    assert "internal engine error while computing this request" in message and "error id" in message
    assert sorted(reason for _, reason in finishes) == ["abort", "error"]  # one fails, its sibling is aborted
    assert not engine.has_unfinished_requests() and not engine.parents and not engine.processors
    assert engine.scheduler.num_running == engine.scheduler.num_waiting == 0
    assert engine.kv.num_used_blocks == 0 and len(engine.runner.grammars) == 0


def test_a_request_left_with_nothing_to_compute_is_failed_not_spun_on(tiny_dir):
    engine = new_engine(tiny_dir)
    engine.add_request("lost", [5, 6, 7], SamplingParams(max_tokens=4))
    engine.scheduler.finish("lost", RequestStatus.FINISHED_ABORTED)  # behind the engine's back, like a bug
    [out] = engine.step()
    assert out.request_id == "lost" and out.finished and "error id" in out.error
    assert [o.finish_reason for o in out.outputs] == ["error"]
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_grpc_a_poisoned_request_is_internal_alone(tiny_dir):
    from tests.unit.test_server_fake_engine import code_of, run

    llm = LLM(model=str(tiny_dir), dtype="float32")
    prompt, params = VICTIMS["seeded"]
    alone = llm.generate([prompt], params)[0].outputs[0]
    engine = llm.engine
    real = engine.runner.execute

    def execute(out, on_launch=None):
        if any(c.request.label == "poison" for c in out.chunks):
            raise RuntimeError("poisoned batch")
        return real(out, on_launch)
    engine.runner.execute = execute
    victim = pb.GenerateRequest(request_id="victim", token_ids=pb.TokenIds(ids=prompt),
                                sampling=pb.SamplingParameters(temperature=1.0, seed=1),
                                stopping=pb.StoppingParameters(max_tokens=16, ignore_eos=True))
    poison = pb.GenerateRequest(request_id="poison", token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                stopping=pb.StoppingParameters(max_tokens=4))

    async def body(h):
        good = asyncio.ensure_future(h.stub.Generate(victim))
        code, details = await code_of(h.stub.Generate(poison))
        return code, details, await good

    code, details, response = run(body, factory=lambda: engine)
    assert code == grpc.StatusCode.INTERNAL and "error id" in details and "other requests went on" in details
    assert response.choices[0].text == alone.text
    assert not engine.has_unfinished_requests()
