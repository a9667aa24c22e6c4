"""Chat messages with tools -> the chat template's inputs.

A template that renders `tools` itself in a known call format (`native`) gets them the way Hugging Face templates
expect: `tools=[{"type": "function", "function": {...}}]`, assistant messages with
`tool_calls` (arguments as objects) and `tool` messages with `tool_call_id`. Any other template
gets Forge's default tool prompt (formats.DEFAULT_TOOL_PROMPT) in the system message, assistant
calls written out as the model would write them, and `tool` messages as they are.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

from forge_service.errors import InvalidArgument
from forge_service.pb import forge_pb2 as pb
from forge_service.tools.formats import DEFAULT_TOOL_PROMPT, ToolCallFormat, renders_tools_natively, select_format
from forge_service.tools.setup import ToolSetup


def template_inputs(messages: Sequence[pb.ChatMessage], setup: ToolSetup | None,
                    template_source: str | None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra template variables). Raises InvalidArgument for a tool message that
    answers no earlier call, or call arguments that are not a JSON object."""
    native = setup.native_template if setup else renders_tools_natively(template_source)
    fmt = setup.format if setup else select_format(template_source)
    names: dict[str, str] = {}  # call id -> function name, from earlier assistant messages
    out = [_message(i, m, native, fmt, names) for i, m in enumerate(messages)]
    if setup is None or not setup.calls_allowed:
        return out, {}
    if native:
        return out, {"tools": setup.openai_tools()}
    return _with_tool_prompt(out, setup), {}


def _message(i: int, m: pb.ChatMessage, native: bool, fmt: ToolCallFormat, names: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name:
        out["name"] = m.name
    if m.reasoning:
        if m.role != "assistant":
            raise InvalidArgument(f"messages[{i}]: only assistant messages carry reasoning, not {m.role!r}")
        out["reasoning_content"] = m.reasoning  # the name thinking models' templates read
    if m.tool_calls:
        if m.role != "assistant":
            raise InvalidArgument(f"messages[{i}]: only assistant messages carry tool_calls, not {m.role!r}")
        calls = [(c, _arguments(i, c)) for c in m.tool_calls]
        for call, _ in calls:
            names[call.id] = call.name
        if native:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": a}}
                                 for c, a in calls]
        else:
            written = fmt.render_calls([(c.name, a) for c, a in calls])
            out["content"] = f"{m.content}\n{written}" if m.content else written
    if m.role == "tool":
        if m.tool_call_id not in names:
            raise InvalidArgument(f"messages[{i}]: tool message with tool_call_id {m.tool_call_id!r} answers no "
                                  "tool call of an earlier assistant message")
        out["tool_call_id"] = m.tool_call_id
        out.setdefault("name", names[m.tool_call_id])
    return out


def _arguments(i: int, call: pb.ToolCall) -> Any:
    try:
        value = json.loads(call.arguments or "{}")
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidArgument(f"messages[{i}]: tool call {call.id!r} has arguments that are not JSON: {e}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"messages[{i}]: tool call {call.id!r} arguments must be a JSON object")
    return value


def _with_tool_prompt(messages: list[dict[str, Any]], setup: ToolSetup) -> list[dict[str, Any]]:
    functions = [t["function"] for t in setup.openai_tools()]
    prompt = DEFAULT_TOOL_PROMPT.format(tools=json.dumps(functions, ensure_ascii=False))
    if messages and messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
