"""The llguidance backend (measured and chosen in bench/structured_backends.md).

JSON Schemas: a schema that is not valid JSON Schema, or that nothing can match, is
INVALID_ARGUMENT. A valid schema is compiled exactly when llguidance can; otherwise it is
approximated (structured/schema.py `relax`, then llguidance's `lenient` and `coerce_one_of`:
`oneOf` as `anyOf`, unimplemented keywords and unknown formats ignored), the approximations
are logged, and the servicer validates the output against the full schema afterwards.
A compiled grammar keeps a primed template matcher; sequences get a deep copy of it (~10 us)
rather than re-parsing the grammar (~1 ms).
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable, Sequence

import llguidance
import torch
from tokenizers import Tokenizer

from forge_service.errors import InvalidArgument
from forge_service.structured.constraint import Constraint
from forge_service.structured.schema import check_schema, relax
from forge_service.tools.grammar import ToolGrammarSpec, lark_grammar

log = logging.getLogger(__name__)

# Single-line JSON with json.dumps' separators and no free whitespace: small models given
# free whitespace can loop on newlines. These are `overrides`, so a schema's own "x-guidance"
# options cannot loosen the grammar (lenient: drop unknown keywords; coerce_one_of: oneOf as anyOf).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                "lenient": False, "coerce_one_of": False}
LENIENT_OPTIONS = {**JSON_OPTIONS, "lenient": True, "coerce_one_of": True}
MASK_THREADS = 2  # LLExecutor threads for batched mask fills
# Work bounds for grammars from clients, well below llguidance's defaults (measured on this
# project's 2-core CPU): a nested counter such as ((a{100}){100}){100} builds its lexer in ~0.06 s
# instead of ~0.6 s and each of its masks costs ~25 ms instead of ~100 ms; a step's mask (on the
# engine's step) stays under ~40 ms; a grammar's lexer holds at most ~10k states (~9 MB). Every
# schema in tests/integration/structured_schemas.py, and schemas with 1,000-value enums or 80
# formatted properties, stay far inside them. A grammar over a limit is refused when it hits it
# while compiling, and ends its own request when it hits it mid-output.
PARSER_LIMITS = dict(initial_lexer_fuel=50_000, step_lexer_fuel=20_000, max_lexer_states=10_000,
                     max_grammar_size=100_000, step_max_items=20_000, verbose_errors=False)


MAX_REASON_CHARS = 400  # llguidance quotes the grammar in its errors; keep the message small


def _reason(error: object) -> str:
    """llguidance's error text, cut to MAX_REASON_CHARS: it may quote a client's whole spec."""
    text = str(error)
    if len(text) <= MAX_REASON_CHARS:
        return text
    return f"{text[:MAX_REASON_CHARS]}... ({len(text) - MAX_REASON_CHARS} more characters)"


def _json_schema(spec: str) -> str:
    try:
        schema = json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidArgument(f"json_schema is not valid JSON: {_reason(e)}") from e
    return llguidance.LLMatcher.grammar_from_json_schema(prepare_schema(schema, "json_schema")[0])


def prepare_schema(schema: Any, what: str) -> tuple[dict[str, Any], list[str]]:
    """The schema llguidance compiles, with Forge's JSON options set in it (overriding any of the
    schema's own "x-guidance"): exact when llguidance can, else approximated (and logged); the
    second item lists the approximations, empty when exact."""
    check_schema(schema)
    if isinstance(schema, bool):
        if not schema:
            raise InvalidArgument(f"{what}: the schema `false` matches nothing")
        schema = {}  # the boolean schema `true` admits every JSON value
    exact = {**schema, "x-guidance": JSON_OPTIONS}
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_json_schema(exact))
    if not failed:
        return exact, []
    relaxed, notes = relax(schema)
    approximate = {**relaxed, "x-guidance": LENIENT_OPTIONS}
    failed, warnings = llguidance.LLMatcher.validate_grammar_with_warnings(
        llguidance.LLMatcher.grammar_from_json_schema(approximate))
    if failed:
        raise InvalidArgument(f"{what}: unsupported or unsatisfiable JSON Schema: {_reason('; '.join(warnings or messages))}")
    notes += warnings
    log.info("%s approximated for the grammar (the output is validated afterwards): %s", what, "; ".join(notes))
    return approximate, notes


def _tool_calls(spec: str) -> str:
    grammar = lark_grammar(ToolGrammarSpec.from_json(spec),
                           lambda schema: json.dumps(prepare_schema(schema, "tool parameters")[0]))
    return llguidance.LLMatcher.grammar_from_lark(grammar)


def _json_object(spec: str) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)


def _choice(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"choice is not a JSON list: {_reason(e)}") from e
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidArgument("choice must be a non-empty JSON list of non-empty strings")
    return llguidance.grammar_from("choice", choices)


def _regex(spec: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(spec)


def _cfg(spec: str) -> str:
    return llguidance.grammar_from("grammar", spec)  # GBNF is converted to Lark; Lark passes through


def _structural_tag(spec: str) -> str:
    """Free text in which each trigger opens one of the structures whose begin starts with it.
    Triggers are matched as text (a trigger that is a special token's text matches that token's
    bytes only where the tokenizer spells it as text)."""
    try:
        tag = json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidArgument(f"structural_tag is not valid JSON: {_reason(e)}") from e
    structures = tag.get("structures") if isinstance(tag, dict) else None
    triggers = tag.get("triggers") if isinstance(tag, dict) else None
    if not isinstance(structures, list) or not structures or not all(isinstance(s, dict) for s in structures):
        raise InvalidArgument("structural_tag needs `structures`, a non-empty list of {begin, schema, end} objects")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise InvalidArgument("structural_tag needs `triggers`, a non-empty list of non-empty strings")
    longest_first = sorted(triggers, key=len, reverse=True)  # a begin takes the longest trigger it starts with
    tags = []
    for i, structure in enumerate(structures):
        begin, end, schema = structure.get("begin"), structure.get("end"), structure.get("schema", True)
        if not isinstance(begin, str) or not isinstance(end, str):
            raise InvalidArgument(f"structural_tag structures[{i}]: begin and end must be strings")
        trigger = next((t for t in longest_first if begin.startswith(t)), None)
        if trigger is None:
            raise InvalidArgument(f"structural_tag structures[{i}]: its begin {begin[:80]!r} starts with none of "
                                  "the triggers")
        schema = prepare_schema(schema, f"structural_tag structures[{i}] schema")[0]
        tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=json.dumps(schema), end=end))
    return llguidance.LLMatcher.grammar_from_lark(llguidance.StructTag.to_grammar(tags, assume_special=False))


# kind -> llguidance grammar text. ValueError from llguidance carries its reason.
GRAMMAR_BUILDERS: dict[str, Callable[[str], str]] = {
    "json_schema": _json_schema, "json_object": _json_object, "choice": _choice, "regex": _regex, "grammar": _cfg,
    "tool_calls": _tool_calls, "structural_tag": _structural_tag,
}


class LLGuidanceMatcher:
    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template
        self._m = template.deep_copy()

    def accept_token(self, token_id: int) -> bool:
        # try_consume_tokens leaves the matcher as it was on a forbidden token; consume_token
        # would put it into a permanent error state. EOS never comes here (GrammarMatcher owns it).
        return self._m.try_consume_tokens([token_id]) == 1

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        assert bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous()
        words = bitmask[row]
        self._m.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def rollback(self, num_tokens: int) -> None:
        ok = self._m.rollback(num_tokens)
        assert ok, self._m.get_error()

    def reset(self) -> None:
        self._m = self._template.deep_copy()


class LLGuidanceGrammar:
    def __init__(self, template: llguidance.LLMatcher, tokenizer: llguidance.LLTokenizer) -> None:
        self._template = template
        self._tokenizer = tokenizer

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template)

    def accepts_text(self, text: str) -> bool:
        # The parser works on bytes, so any tokenization of the text is as good as the sampled one.
        m = self._template.deep_copy()
        tokens = self._tokenizer.tokenize_str(text)
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()


class LLGuidanceBackend:
    """llguidance over one tokenizer. Building the token trie takes ~1 s; do it once per tokenizer."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        # n_vocab is the model's logit width; ids past the tokenizer's own are never allowed.
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        self._limits = llguidance.LLParserLimits(**PARSER_LIMITS)

    def compile(self, constraint: Constraint) -> LLGuidanceGrammar:
        try:
            grammar = GRAMMAR_BUILDERS[constraint.kind](constraint.spec)
        except ValueError as e:
            raise InvalidArgument(f"invalid {constraint.kind}: {_reason(e)}") from e
        # Parsing happens here and drops the GIL; errors leave the matcher in an error state.
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        # The first mask builds the lexer's start state (~0.5 ms); do it here, off the step loop.
        # A grammar that cannot start (a $ref cycle, a limit hit) errors there, and is refused.
        if not template.is_error():
            template.compute_bitmask()
        if template.is_error():
            raise InvalidArgument(f"unsupported or invalid {constraint.kind}: {_reason(template.get_error())}")
        return LLGuidanceGrammar(template, self._tokenizer)

    def fill_bitmasks(self, matchers: Sequence[LLGuidanceMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        assert bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous()
        pairs = [(m._m, row) for m, row in zip(matchers, rows)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
