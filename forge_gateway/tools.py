"""Tool calling between OpenAI JSON and forge.v1: request fields in, message and delta
`tool_calls` out. The service renders, enforces and parses the calls; this only maps shapes."""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from forge_service.pb import forge_pb2 as pb


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str = Field("{}", description="the arguments object as JSON text")


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


_MODES = {"none": pb.TOOL_CHOICE_MODE_NONE, "auto": pb.TOOL_CHOICE_MODE_AUTO,
          "required": pb.TOOL_CHOICE_MODE_REQUIRED}


def request_fields(tools: list[ToolDef] | None, tool_choice: ToolChoice | None,
                   parallel_tool_calls: bool | None) -> dict[str, Any]:
    """GenerateRequest fields for a chat request's tools (the service checks them)."""
    out: dict[str, Any] = {}
    if tools:
        out["tools"] = [pb.Tool(name=t.function.name, description=t.function.description or "",
                                parameters=json.dumps(t.function.parameters) if t.function.parameters is not None
                                else "", strict=bool(t.function.strict)) for t in tools]
    if isinstance(tool_choice, NamedToolChoice):
        out["tool_choice"] = pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_FUNCTION, function_name=tool_choice.function.name)
    elif tool_choice is not None:
        out["tool_choice"] = pb.ToolChoice(mode=_MODES[tool_choice])
    if parallel_tool_calls is not None:
        out["parallel_tool_calls"] = parallel_tool_calls
    return out


def message_fields(tool_calls: list[MessageToolCall] | None, tool_call_id: str | None) -> dict[str, Any]:
    """ChatMessage fields for an assistant message's calls or a tool message's answer."""
    out: dict[str, Any] = {}
    if tool_calls:
        out["tool_calls"] = [pb.ToolCall(id=c.id, name=c.function.name, arguments=c.function.arguments)
                             for c in tool_calls]
    if tool_call_id is not None:
        out["tool_call_id"] = tool_call_id
    return out


def message_tool_calls(calls: Any) -> list[dict[str, Any]]:
    """OpenAI's message.tool_calls for a choice's ToolCalls."""
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def delta_tool_calls(deltas: Any) -> list[dict[str, Any]]:
    """OpenAI's delta.tool_calls: id, type and name in a call's first piece, then arguments."""
    out = []
    for d in deltas:
        if d.id:
            out.append({"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out
