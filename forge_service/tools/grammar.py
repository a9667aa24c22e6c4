"""Grammars that enforce tool calls, as Lark text for the grammar engine (llguidance's Lark).

`required` (and a named function): the whole output is one or more calls in the model's format,
each `{"name": <a tool's name>, <arguments_key>: <arguments>}` whose arguments match that tool's
parameters schema; with parallel_tool_calls off, exactly one call.

`auto`: free text, in which a call may start. The call markup is a lazy lexeme: free text
ends as soon as the start tag appears, and from there the call is constrained like `required`.
For formats without a start tag (the call is the whole answer) the output is either calls or
text that does not begin with '{'.

The JSON of each call is embedded with `%json`; `embed_schema` turns a schema into the JSON text
to embed (the backend adds its JSON options and approximations, see llguidance_backend.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from forge_service.tools.formats import FORMATS_BY_NAME, ToolCallFormat

MODES = ("auto", "required")


@dataclass(frozen=True)
class ToolGrammarSpec:
    """What the grammar must enforce; travels as the JSON text of a `tool_calls` Constraint."""

    format: str
    mode: str
    parallel: bool
    tools: tuple[tuple[str, Any], ...]  # (name, parameters schema) of the callable tools

    def to_json(self) -> str:
        return json.dumps({"format": self.format, "mode": self.mode, "parallel": self.parallel,
                           "tools": [{"name": n, "parameters": p} for n, p in self.tools]}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ToolGrammarSpec:
        data = json.loads(text)
        assert data["mode"] in MODES and data["format"] in FORMATS_BY_NAME, data
        return cls(data["format"], data["mode"], bool(data["parallel"]),
                   tuple((t["name"], t["parameters"]) for t in data["tools"]))


def call_schema(fmt: ToolCallFormat, name: str, parameters: Any) -> dict[str, Any]:
    """The JSON Schema of one call object; `name` comes first, so it streams first."""
    return {"type": "object", "properties": {"name": {"const": name}, fmt.arguments_key: parameters},
            "required": ["name", fmt.arguments_key], "additionalProperties": False}


def lark_grammar(spec: ToolGrammarSpec, embed_schema: Callable[[dict[str, Any]], str]) -> str:
    fmt = FORMATS_BY_NAME[spec.format]
    objects = " | ".join(f"%json {embed_schema(call_schema(fmt, n, p))}" for n, p in spec.tools)
    lines = ["%llguidance {}", f"obj: {objects}"]
    if fmt.list_in_region:
        lines.append("calls: " + _seq(_lit(fmt.start), _objects(fmt, spec.parallel, bool(fmt.start)), _lit(fmt.end)))
    else:
        lines.append("call: " + _seq(_lit(fmt.start), "obj", _lit(fmt.end)))
        lines.append(f"calls: call ({_lit(fmt.separator)} call)*" if spec.parallel else "calls: call")
    lines += _auto_rules(fmt, spec.parallel) if spec.mode == "auto" else ["start: calls"]
    return "\n".join(lines) + "\n"


def _auto_rules(fmt: ToolCallFormat, parallel: bool) -> list[str]:
    if not fmt.start:
        return ["start: calls | FREE", r"FREE: /([^{](.|\n)*)?/"]
    trigger = fmt.start.strip()
    rest = fmt.start[fmt.start.index(trigger) + len(trigger):]
    region = _objects(fmt, parallel, True) if fmt.list_in_region else "obj"
    return [
        "start: tagged* tail" if parallel else "start: tail | tagged",
        "tail: TEXT",
        r"TEXT: /(.|\n)*/",
        f"trig[lazy]: TEXT {_lit(trigger)}",
        "tagged: " + _seq("trig", _lit(rest), region, _lit(fmt.end)),
    ]


def _objects(fmt: ToolCallFormat, parallel: bool, bracketed: bool) -> str:
    many = f"obj ({_lit(fmt.separator)} obj)*" if parallel else "obj"
    return f'"[" {many} "]"' if bracketed else many


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p)


def _lit(text: str) -> str:
    """A Lark string literal; empty text is no literal at all."""
    return json.dumps(text) if text else ""
