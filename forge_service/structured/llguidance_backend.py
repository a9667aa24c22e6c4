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


def _json_schema(spec: str) -> str:
    try:
        schema = json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidArgument(f"json_schema is not valid JSON: {e}") from e
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
        raise InvalidArgument(f"{what}: unsupported or unsatisfiable JSON Schema: {'; '.join(warnings or messages)}")
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
        raise InvalidArgument(f"choice is not a JSON list: {e}") from e
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidArgument("choice must be a non-empty JSON list of non-empty strings")
    return llguidance.grammar_from("choice", choices)


def _regex(spec: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(spec)


def _cfg(spec: str) -> str:
    return llguidance.grammar_from("grammar", spec)  # GBNF is converted to Lark; Lark passes through


# kind -> llguidance grammar text. ValueError from llguidance carries its reason.
GRAMMAR_BUILDERS: dict[str, Callable[[str], str]] = {
    "json_schema": _json_schema, "json_object": _json_object, "choice": _choice, "regex": _regex, "grammar": _cfg,
    "tool_calls": _tool_calls,
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
    def __init__(self, template: llguidance.LLMatcher) -> None:
        self._template = template

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template)


class LLGuidanceBackend:
    """llguidance over one tokenizer. Building the token trie takes ~1 s; do it once per tokenizer."""

    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        # n_vocab is the model's logit width; ids past the tokenizer's own are never allowed.
        self._tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self._executor = llguidance.LLExecutor(num_threads=MASK_THREADS)

    def compile(self, constraint: Constraint) -> LLGuidanceGrammar:
        try:
            grammar = GRAMMAR_BUILDERS[constraint.kind](constraint.spec)
        except ValueError as e:
            raise InvalidArgument(f"invalid {constraint.kind}: {e}") from e
        # Parsing happens here and drops the GIL; errors leave the matcher in an error state.
        template = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if template.is_error():
            raise InvalidArgument(f"unsupported or invalid {constraint.kind}: {template.get_error()}")
        # The first mask builds the lexer's start state (~0.5 ms); do it here, off the step loop.
        template.compute_bitmask()
        return LLGuidanceGrammar(template)

    def fill_bitmasks(self, matchers: Sequence[LLGuidanceMatcher], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        assert bitmask.dtype == torch.int32 and bitmask.is_cpu and bitmask.is_contiguous()
        pairs = [(m._m, row) for m, row in zip(matchers, rows)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
