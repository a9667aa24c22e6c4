"""A request's tools, checked: proto fields -> ToolSetup (what to render, enforce and parse)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from forge_service.errors import InvalidArgument, blame
from forge_service.pb import forge_pb2 as pb
from forge_service.structured.constraint import Constraint
from forge_service.structured.schema import check_schema, close_objects
from forge_service.tools.formats import ToolCallFormat, renders_tools_natively, select_format
from forge_service.tools.grammar import ToolGrammarSpec

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_MODES = {pb.TOOL_CHOICE_MODE_UNSPECIFIED: "auto", pb.TOOL_CHOICE_MODE_AUTO: "auto",
          pb.TOOL_CHOICE_MODE_NONE: "none", pb.TOOL_CHOICE_MODE_REQUIRED: "required",
          pb.TOOL_CHOICE_MODE_FUNCTION: "function"}


@dataclass(frozen=True)
class ToolDef:
    name: str
    description: str
    parameters: Any  # the JSON Schema as given (strict closing applied when asked)


@dataclass(frozen=True)
class ToolSetup:
    """Everything a request's tools change: the prompt, the grammar, and the output parsing."""

    tools: tuple[ToolDef, ...]
    mode: str  # "none", "auto", "required" or "function"
    function: str  # with mode "function"
    parallel: bool
    format: ToolCallFormat
    native_template: bool  # the chat template renders `tools` itself

    @property
    def calls_allowed(self) -> bool:
        return self.mode != "none"

    def constraint(self) -> Constraint | None:
        """The grammar that enforces the calls; None with tool_choice none."""
        if not self.calls_allowed:
            return None
        chosen = [t for t in self.tools if self.mode != "function" or t.name == self.function]
        spec = ToolGrammarSpec(self.format.name, "auto" if self.mode == "auto" else "required",
                               self.parallel and self.mode != "function",
                               tuple((t.name, t.parameters) for t in chosen))
        return Constraint("tool_calls", spec.to_json())

    def schema_of(self, name: str) -> Any | None:
        return next((t.parameters for t in self.tools if t.name == name), None)

    def openai_tools(self) -> list[dict[str, Any]]:
        """The tools as Hugging Face chat templates expect them (OpenAI's shape)."""
        return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.parameters}} for t in self.tools]


def tool_setup(request: pb.GenerateRequest, template_source: str | None,
               format_name: str | None = None) -> ToolSetup | None:
    """The request's ToolSetup, or None when it has no tools. Raises InvalidArgument (about tools
    where it names no other field)."""
    with blame("tools"):
        return _tool_setup(request, template_source, format_name)


def _tool_setup(request: pb.GenerateRequest, template_source: str | None, format_name: str | None) -> ToolSetup | None:
    choice = request.tool_choice if request.HasField("tool_choice") else None
    if not request.tools:
        if choice is not None and choice.mode != pb.TOOL_CHOICE_MODE_NONE:
            raise InvalidArgument("tool_choice is set but the request has no tools", field="tool_choice")
        return None
    if request.WhichOneof("input") != "chat":
        raise InvalidArgument("tools need chat input (messages)")
    tools = _tools(request.tools)
    mode = _MODES.get(choice.mode if choice else 0)
    if mode is None:
        raise InvalidArgument(f"unknown tool_choice mode {choice.mode}", field="tool_choice")
    function = choice.function_name if choice else ""
    if mode == "function" and function not in {t.name for t in tools}:
        raise InvalidArgument(f"tool_choice names the function {function!r}, which is not among the tools "
                              f"({', '.join(t.name for t in tools)})", field="tool_choice")
    if mode != "none" and request.WhichOneof("constraint") is not None:
        raise InvalidArgument("tool_choice other than none cannot be combined with a structured output "
                              "constraint (response_format); set tool_choice to none or drop one of them",
                              field="tool_choice")
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    return ToolSetup(tools, mode, function, parallel, select_format(template_source, format_name),
                     renders_tools_natively(template_source))


def _tools(tools: Any) -> tuple[ToolDef, ...]:
    out, seen = [], set()
    for i, tool in enumerate(tools):
        if not _NAME.fullmatch(tool.name):
            raise InvalidArgument(f"tools[{i}].name must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-', got {tool.name!r}")
        if tool.name in seen:
            raise InvalidArgument(f"tools[{i}].name {tool.name!r} is used twice")
        seen.add(tool.name)
        out.append(ToolDef(tool.name, tool.description, _parameters(i, tool)))
    return tuple(out)


def _parameters(i: int, tool: pb.Tool) -> Any:
    if not tool.parameters:
        return {"type": "object"}
    try:
        schema = json.loads(tool.parameters)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidArgument(f"tools[{i}].parameters is not valid JSON: {e}") from None
    try:
        check_schema(schema)
    except InvalidArgument as e:
        raise InvalidArgument(f"tools[{i}] ({tool.name}).parameters: {e}") from None
    return close_objects(schema) if tool.strict else schema
