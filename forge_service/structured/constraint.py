"""What a request asks its output to match: plain data, hashable, the grammar cache key."""
from __future__ import annotations

from dataclasses import dataclass

from forge_service.errors import InvalidArgument

# kind -> what `spec` holds
KINDS: dict[str, str] = {
    "json_schema": "JSON Schema text",
    "json_object": "ignored: any JSON object",
    "regex": "a regular expression (Rust `regex` syntax) the whole output must match",
    "choice": "a JSON list of strings; the output is exactly one of them",
    "grammar": "a context-free grammar: GBNF (llama.cpp EBNF, `root ::= ...`) or Lark (`start: ...`)",
    "tool_calls": "a forge_service.tools.grammar.ToolGrammarSpec as JSON: tool calls in the model's format",
    "structural_tag": 'JSON {"structures": [{"begin", "schema", "end"}], "triggers": [...]}: free text in which '
                      "each trigger opens a structure: its begin, JSON its schema admits, its end",
}


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint. Equal constraints share one compiled grammar."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"unknown structured output kind {self.kind!r}; expected one of {sorted(KINDS)}")
        if not isinstance(self.spec, str):
            raise InvalidArgument(f"structured output {self.kind} must be given as a string")
        if self.kind != "json_object" and not self.spec.strip():
            raise InvalidArgument(f"structured output {self.kind} is empty")
