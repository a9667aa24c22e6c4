"""What the servicer does to generated text before it leaves: reasoning split off, tool-call
parsing and the after-the-fact schema check.

One OutputProcessor per request, fed each completion's text deltas in order, for Stream and
Generate alike. Splitting reasoning, it takes a thinking model's thought out of the text first
(reasoning.py), so that calls and the schema check see the answer alone. With tools it splits
text into content and calls (parser.py); at the end of a
completion it validates every complete call's arguments against its tool's full schema (a call
cut short by max_tokens is not checked, as a json_schema output cut short is not), and a
json_schema output against its schema, logging violations (the grammar may have approximated
the schema; see structured/schema.py). It never fails a request after the fact.
"""
from __future__ import annotations

import logging
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from forge_service.reasoning import ReasoningSplitter
from forge_service.structured.schema import OutputValidator
from forge_service.tools.parser import ParsedCall, ToolCallDelta, ToolCallParser
from forge_service.tools.setup import ToolSetup

log = logging.getLogger(__name__)
_ID_CHARS = string.ascii_letters + string.digits

# Called with (what, valid) for each checked output: ("tool_call" | "json_schema", bool).
ValidationHook = Callable[[str, bool], None]


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(24))


@dataclass
class Piece:
    """What one text delta of one completion becomes."""

    text: str
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""


class OutputProcessor:
    def __init__(self, request_id: str, tools: ToolSetup | None, json_schema: Any | None = None,
                 on_validated: ValidationHook | None = None, reasoning: bool = False, in_thought: bool = False,
                 include_reasoning: bool = True, close_token: int | None = None) -> None:
        """`reasoning`: split thoughts off; `in_thought`: the prompt left one open; without
        `include_reasoning` they are split off and dropped. `close_token`: the id of </think>
        where it is one token, which makes the thought's token count exact."""
        self._close_token = close_token
        self.request_id = request_id
        self._reasoning = reasoning
        self._in_thought = in_thought
        self._include_reasoning = include_reasoning
        self._splitters: dict[int, ReasoningSplitter] = {}
        self._thought_tokens: dict[int, int] = {}
        self._undecided_tokens: dict[int, int] = {}  # before a thought may open (e.g. "<thi")
        self._tools = tools if tools is not None and tools.calls_allowed else None
        self._schema = OutputValidator(json_schema) if json_schema is not None else None
        self._tool_validators: dict[str, OutputValidator] = {}
        self._parsers: dict[int, ToolCallParser] = {}
        self._texts: dict[int, list[str]] = {}
        self._on_validated = on_validated

    @property
    def parses_tools(self) -> bool:
        return self._tools is not None

    def feed(self, index: int, text: str, token_ids: Sequence[int] = ()) -> Piece:
        """The next text delta of completion `index`, decoded from `token_ids`."""
        reasoning = ""
        if self._reasoning:
            splitter = self._splitter(index)
            reasoning, text = splitter.feed(text)
            held = self._undecided_tokens.pop(index, 0) + self._thought_part(token_ids, splitter)
            if splitter.thought_seen:
                self._thought_tokens[index] = self._thought_tokens.get(index, 0) + held
            elif splitter.undecided:
                self._undecided_tokens[index] = held
        return self._answer(index, text, reasoning)

    def _thought_part(self, token_ids: Sequence[int], splitter: ReasoningSplitter) -> int:
        """How many of a delta's tokens go with a thought it was part of: all of them, but for the
        delta that closed it only those through the closing tag where that is one token (else
        that delta counts whole)."""
        if not splitter.thought_seen or splitter.thought_open or self._close_token not in token_ids:
            return len(token_ids)
        return list(token_ids).index(self._close_token) + 1

    def reasoning_tokens(self, index: int) -> int:
        """Tokens of completion `index` that belonged to its thought so far."""
        return self._thought_tokens.get(index, 0)

    def finish(self, index: int, finish_reason: str | None) -> tuple[Piece, list[ParsedCall], str | None]:
        """The last piece, the completion's calls, and its finish reason ("tool_calls" when it
        called tools and stopped)."""
        piece, calls = Piece(""), []
        if self._reasoning:
            reasoning, text = self._splitter(index).finish()
            del self._splitters[index]
            piece = self._answer(index, text, reasoning)
        if self._tools is not None:
            parser = self._parser(index)
            content, deltas = parser.finish()
            piece = Piece(piece.text + content, piece.tool_calls + deltas, piece.reasoning)
            calls = parser.calls
            self._check_calls(calls)
            if calls and finish_reason == "stop":
                finish_reason = "tool_calls"
        if self._schema is not None and finish_reason == "stop":
            self._check("json_schema", self._schema, "".join(self._texts.pop(index, [])))
        return piece, calls, finish_reason

    def _answer(self, index: int, text: str, reasoning: str) -> Piece:
        # the answer's text through tool-call parsing, beside the thought's
        if not self._include_reasoning:
            reasoning = ""
        if self._schema is not None:
            self._texts.setdefault(index, []).append(text)
        if self._tools is None:
            return Piece(text, reasoning=reasoning)
        content, deltas = self._parser(index).feed(text)
        return Piece(content, deltas, reasoning)

    def _splitter(self, index: int) -> ReasoningSplitter:
        if index not in self._splitters:
            self._splitters[index] = ReasoningSplitter(self._in_thought)
        return self._splitters[index]

    def _parser(self, index: int) -> ToolCallParser:
        if index not in self._parsers:
            assert self._tools is not None
            self._parsers[index] = ToolCallParser(self._tools.format, new_call_id,
                                                  calls_only=self._tools.mode in ("required", "function"))
        return self._parsers[index]

    def _check_calls(self, calls: list[ParsedCall]) -> None:
        assert self._tools is not None
        for call in calls:
            schema = self._tools.schema_of(call.name)
            if schema is None:
                log.warning("request %s: the model called an unknown tool %r", self.request_id, call.name)
                continue
            if not call.complete:  # cut short: its arguments were never whole
                continue
            if call.name not in self._tool_validators:
                self._tool_validators[call.name] = OutputValidator(schema)
            self._check(f"tool_call {call.name}", self._tool_validators[call.name], call.arguments)

    def _check(self, what: str, validator: OutputValidator, text: str) -> None:
        valid = validator.check(text, what, self.request_id)
        if self._on_validated is not None:
            self._on_validated(what.split(" ")[0], valid)
