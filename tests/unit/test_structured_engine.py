"""Structured output inside the engine, on a tiny random-weight Llama (byte-level vocabulary).

A random model's choices are arbitrary, so any output that matches its constraint shows the
mask at work: chunked prefill, preemption, n > 1, seeds, logprobs, EOS and max_tokens.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from forge_service import LLM, SamplingParams
from forge_service.errors import InvalidArgument
from forge_service.sampling import RowSampling, Sampler, SamplingMetadata
from forge_service.structured import (Constraint, GrammarCompiler, GrammarMatcher, MatcherSet, pack_bitmask,
                                      unpack_bitmask)
from tests.tiny_models import CHATML_TEMPLATE, random_weights, tiny_arch, tiny_tokenizer_json, write_safetensors_dir

EOS = 2  # <|im_end|>
PATTERN = r"[a-c]{2,6}(-[0-9]{1,3}){1,2}"
REGEX = Constraint("regex", PATTERN)
PERSON = Constraint("json_schema", json.dumps({
    "type": "object", "properties": {"name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}},
    "required": ["name", "ok"], "additionalProperties": False}))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    arch = tiny_arch()
    root = tmp_path_factory.mktemp("tiny-structured")
    write_safetensors_dir(root, arch, random_weights(arch, seed=5), tokenizer_json=tiny_tokenizer_json(),
                          chat_template=CHATML_TEMPLATE)
    return root


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(model=str(tiny_dir), dtype="float32", max_num_batched_tokens=64)


def prompts(k: int, length: int = 20) -> list[list[int]]:
    return [list(range(3 + i, 3 + i + length + 5 * i)) for i in range(k)]


def test_regex_outputs_match_under_chunked_prefill_preemption_and_n(tiny_dir):
    # 12 blocks of 8 tokens for 4 requests of up to 3 x (50 + 24) tokens: preemption is certain.
    small = LLM(model=str(tiny_dir), dtype="float32", num_blocks=12, block_size=8, max_num_batched_tokens=32)
    params = [SamplingParams(n=3, temperature=1.0, seed=i, max_tokens=24, logprobs=2, constraint=REGEX)
              for i in range(4)]
    outs = small.generate(prompts(4, 35), params)
    assert small.engine.num_preemptions > 0
    finished = 0
    for out in outs:
        assert len(out.outputs) == 3
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids)
            if c.finish_reason == "stop":
                assert re.fullmatch(PATTERN, c.text), c.text
                assert c.stop_reason == EOS and c.token_ids[-1] == EOS
                finished += 1
            else:
                assert c.finish_reason == "length" and len(c.token_ids) == 24
                assert re.fullmatch(r"[a-c]{0,6}(-[0-9]{0,3}){0,2}", c.text), c.text  # a prefix
    assert finished >= 6
    assert len(small.engine.runner.grammars) == 0  # matchers are released with their requests


def test_json_schema_output_parses(llm):
    outs = llm.generate(prompts(4), [SamplingParams(temperature=1.0, seed=i, max_tokens=48, constraint=PERSON)
                                     for i in range(4)])
    stopped = [c.text for o in outs for c in o.outputs if c.finish_reason == "stop"]
    assert stopped
    for text in stopped:
        value = json.loads(text)
        assert set(value) == {"name", "ok"} and isinstance(value["ok"], bool) and len(value["name"]) <= 5


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_ends_constrained_output_only_where_it_is_complete(llm, include):
    """Every output that finishes with `stop` parses: a stop string inside unfinished JSON is text."""
    stops = ['"', "}", ",", ": "]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=48, constraint=PERSON, stop=stops,
                             include_stop_str_in_output=include) for i in range(6)]
    outs = [c for o in llm.generate(prompts(6), params) for c in o.outputs]
    stopped = [c for c in outs if c.finish_reason == "stop"]
    assert stopped
    for c in stopped:
        value = json.loads(c.text)
        assert set(value) == {"name", "ok"}
        # without the stop in the output nothing before a stop is a whole object: EOS ends it;
        # with it, the closing brace is the stop
        assert c.stop_reason == ("}" if include else EOS), (c.text, c.stop_reason)


def test_a_stop_string_still_ends_constrained_output_where_the_grammar_may_end(llm):
    regex = Constraint("regex", "[a-c]{1,3}(x[a-c]{1,3}){0,4}")
    outs = llm.generate(prompts(6), [SamplingParams(temperature=1.0, seed=i, max_tokens=30, constraint=regex,
                                                    stop=["x"]) for i in range(6)])
    by_string = [c for o in outs for c in o.outputs if c.stop_reason == "x"]
    assert by_string  # the random model writes an "x" in some of them
    for c in by_string:
        assert re.fullmatch("[a-c]{1,3}", c.text), c.text


def test_stop_token_ids_other_than_eos_are_refused_with_a_constraint(llm):
    with pytest.raises(InvalidArgument, match="stop_token_ids cannot be combined with structured output"):
        llm.generate(prompts(1), SamplingParams(max_tokens=8, constraint=PERSON, stop_token_ids=[40]))
    out = llm.generate(prompts(1), SamplingParams(max_tokens=48, constraint=PERSON, stop_token_ids=[EOS]))
    assert out[0].outputs[0].finish_reason in ("stop", "length")


def test_a_grammar_that_hits_a_work_limit_mid_output_ends_only_its_own_request(llm):
    """A nested counter compiles, then exhausts the lexer's limits on its first tokens: that request
    ends (`abort`), and the request beside it gets exactly its solo output."""
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    solo = llm.generate(prompts(2)[1:], free)[0].outputs[0].token_ids
    limit = SamplingParams(temperature=0, max_tokens=12, constraint=Constraint("regex", "((a{100}){100}){100}"))
    hit, other = llm.generate(prompts(2), [limit, free])
    assert hit.outputs[0].finish_reason == "abort" and len(hit.outputs[0].token_ids) < 12
    assert other.outputs[0].token_ids == solo
    assert not llm.engine.has_unfinished_requests() and len(llm.engine.runner.grammars) == 0


def test_the_engine_takes_its_grammar_limits_from_the_config(tiny_dir):
    from forge_service.config import EngineConfig, ModelConfig, StructuredConfig
    from forge_service.engine.engine import LLMEngine
    engine = LLMEngine(EngineConfig(model=ModelConfig(model=str(tiny_dir), dtype="float32"),
                                    structured=StructuredConfig(max_grammar_bytes=64, grammar_compile_timeout_s=0.25)))
    try:
        assert (engine.grammar_compiler.max_spec_bytes, engine.grammar_compiler.compile_timeout_s) == (64, 0.25)
        with pytest.raises(InvalidArgument, match="65 bytes; the limit is 64"):
            engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, constraint=Constraint("regex", "a" * 65)))
    finally:
        engine.grammar_compiler.shutdown()


def test_unconstrained_rows_equal_their_solo_runs(llm):
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=3)
    ps = prompts(6)
    solo = [llm.generate([p], free if i % 2 else seeded)[0].outputs[0] for i, p in enumerate(ps)]
    mixed = [free if i % 2 else seeded for i in range(6)] + [SamplingParams(temperature=0.8, seed=i, max_tokens=12,
                                                                         constraint=REGEX) for i in range(6)]
    together = llm.generate(ps + ps, mixed)
    for alone, out in zip(solo, together[:6]):
        assert out.outputs[0].token_ids == alone.token_ids
        if alone.logprobs:
            assert [p[0].logprob for p in out.outputs[0].logprobs] == pytest.approx(
                [p[0].logprob for p in alone.logprobs], abs=1e-5)


def test_seeded_constrained_output_does_not_depend_on_the_batch(llm):
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=20, constraint=REGEX)
    alone = llm.generate(prompts(1), params)[0].outputs[0].token_ids
    crowd = llm.generate(prompts(5), [params] + [SamplingParams(temperature=1.0, max_tokens=20)] * 4)
    assert crowd[0].outputs[0].token_ids == alone


def test_a_complete_choice_ends_with_eos_even_with_ignore_eos(llm):
    choice = Constraint("choice", json.dumps(["yes", "no", "maybe"]))
    outs = llm.generate(prompts(3), SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, constraint=choice))
    for out in outs:
        c = out.outputs[0]
        assert c.text in {"yes", "no", "maybe"} and c.finish_reason == "stop" and c.stop_reason == EOS


def test_max_tokens_first_is_length_never_stop(llm):
    c = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=3,
                                                constraint=Constraint("regex", "a{10}")))[0].outputs[0]
    assert (c.text, c.finish_reason) == ("aaa", "length")


def test_invalid_constraint_is_refused_before_anything_is_queued(llm):
    with pytest.raises(InvalidArgument, match="unclosed group"):
        llm.generate(prompts(2), [SamplingParams(max_tokens=4), SamplingParams(constraint=Constraint("regex", "(a"))])
    assert not llm.engine.has_unfinished_requests() and len(llm.engine.runner.grammars) == 0


def test_a_refused_token_aborts_the_request(llm, monkeypatch):
    monkeypatch.setattr(GrammarMatcher, "accept_token", lambda self, token: False)
    c = llm.generate(prompts(1), SamplingParams(temperature=0, max_tokens=8, constraint=REGEX))[0].outputs[0]
    assert c.finish_reason == "abort" and len(c.token_ids) == 1
    assert len(llm.engine.runner.grammars) == 0


# --- the pieces --------------------------------------------------------------------------------

def test_matcher_set_masks_only_constrained_rows(llm):
    compiler = llm.engine.grammar_compiler
    grammars = MatcherSet(compiler)
    assert grammars.bitmask(["a", "b"]) is None  # nothing constrained: no mask at all
    grammars.add("b", compiler.compile(Constraint("regex", "xy")))
    assert grammars.bitmask(["a", "c"]) is None
    allowed = unpack_bitmask(grammars.bitmask(["a", "b"]), 320)  # [2, V]
    x, y = (llm.tokenizer.encode(c, add_special_tokens=False)[0] for c in "xy")
    assert allowed[0].all() and allowed[1].nonzero().flatten().tolist() == [x]
    assert grammars.accept(["a", "b"], [y, x]) == set()  # unconstrained rows take anything
    assert grammars.accept(["b"], [x]) == {"b"}  # "xx" is outside the grammar
    assert grammars.accept(["b"], [y]) == set() and grammars.get("b").can_end()
    grammars.release("b")
    assert len(grammars) == 0


def test_sampler_applies_a_packed_bitmask_and_leaves_other_rows_alone():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 300, generator=g)
    before = logits.clone()
    allowed = torch.ones(4, 300, dtype=torch.bool)
    allowed[1] = False
    allowed[1, [7, 250]] = True
    allowed[3] = torch.rand(300, generator=g) < 0.1
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1),
              SamplingParams(temperature=1.0, seed=2)]

    def sample(mask):
        rows = [RowSampling(p, [1], [], torch.Generator().manual_seed(p.seed) if p.seed else None) for p in params]
        meta = SamplingMetadata.build(rows, 300)
        meta.token_bitmask = mask
        return Sampler()(logits, meta).token_ids.tolist()

    unmasked, packed, bools = sample(None), sample(pack_bitmask(allowed)), sample(allowed)
    assert torch.equal(logits, before)  # the caller's logits are never modified
    assert packed == bools
    assert packed[0] == unmasked[0] and packed[2] == unmasked[2]  # all-allowed rows: unchanged
    assert packed[1] == max((7, 250), key=lambda t: float(logits[1, t])) and allowed[3, packed[3]]


def test_a_model_without_eos_refuses_constraints_but_loads(llm):
    compiler = GrammarCompiler(llm.tokenizer.backend, 320, [])
    with pytest.raises(InvalidArgument, match="end-of-sequence"):
        compiler.compile(REGEX)
    compiler.shutdown()
