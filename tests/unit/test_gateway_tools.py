"""Tool calling in the gateway's conversions: OpenAI JSON <-> forge.v1."""
from __future__ import annotations

import json

import pydantic
import pytest

from forge_gateway import convert, streams
from forge_gateway.models import ChatCompletionRequest
from forge_service.pb import forge_pb2 as pb

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                                            "strict": True}}


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=fields.pop("messages", [{"role": "user", "content": "hi"}]),
                                 **fields)


def test_tools_tool_choice_and_parallel_map_to_the_proto() -> None:
    req = convert.chat_request(body(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False), "r")
    [tool] = req.tools
    assert (tool.name, tool.description, tool.strict) == ("get_weather", "Weather in a city", True)
    assert json.loads(tool.parameters) == WEATHER["function"]["parameters"]
    assert req.tool_choice.mode == pb.TOOL_CHOICE_MODE_REQUIRED and req.parallel_tool_calls is False
    named = convert.chat_request(body(tools=[WEATHER], tool_choice={"type": "function",
                                                                    "function": {"name": "get_weather"}}), "r")
    assert named.tool_choice == pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_FUNCTION, function_name="get_weather")
    plain = convert.chat_request(body(), "r")
    assert not plain.tools and not plain.HasField("tool_choice") and not plain.HasField("parallel_tool_calls")
    assert convert.chat_request(body(tool_choice="none"), "r").tool_choice.mode == pb.TOOL_CHOICE_MODE_NONE


def test_assistant_tool_calls_and_tool_messages_map_to_the_proto() -> None:
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    req = convert.chat_request(body(messages=messages, tools=[WEATHER]), "r")
    assistant, tool = req.chat.messages[1], req.chat.messages[2]
    assert assistant.content == "" and list(assistant.tool_calls) == [
        pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')]
    assert (tool.role, tool.tool_call_id, tool.content) == ("tool", "call_1", "21 C")


def test_response_format_strict_is_passed_on() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}
    assert convert.chat_request(body(response_format=fmt), "r").json_schema_strict
    fmt["json_schema"]["strict"] = False
    assert not convert.chat_request(body(response_format=fmt), "r").json_schema_strict


@pytest.mark.parametrize("fields", [
    {"tool_choice": "always"},
    {"tools": [{"type": "retrieval"}]},
    {"tools": [{"type": "function", "function": {"description": "no name"}}]},
    {"tool_choice": {"type": "function"}},
])
def test_malformed_tool_fields_are_refused(fields) -> None:
    with pytest.raises(pydantic.ValidationError):
        body(**fields)


def test_tool_calls_in_a_whole_response() -> None:
    call = pb.ToolCall(id="call_a", name="get_weather", arguments='{"city": "Paris"}')
    resp = pb.GenerateResponse(model="m", choices=[
        pb.Choice(index=0, text="", finish_reason=pb.FINISH_REASON_TOOL_CALLS, tool_calls=[call]),
        pb.Choice(index=1, text="Sure.", finish_reason=pb.FINISH_REASON_TOOL_CALLS, tool_calls=[call]),
        pb.Choice(index=2, text="", finish_reason=pb.FINISH_REASON_STOP)])
    out = convert.chat_completion(resp, "id", 0, "m", False)
    first, second, third = (c["message"] for c in out["choices"])
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert first == {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert second["content"] == "Sure." and third == {"role": "assistant", "content": "", "refusal": None}


def test_streamed_tool_call_deltas() -> None:
    stream = streams.ChatStream("id", 0, "m", 1, False, False)
    deltas = [pb.ToolCallDelta(index=0, id="call_a", name="get_weather"),
              pb.ToolCallDelta(index=0, arguments='{"city": '), pb.ToolCallDelta(index=0, arguments='"Paris"}')]
    chunks = [stream.on_message(0, pb.StreamResponse(chunk=pb.StreamChunk(index=0, tool_calls=[d]))) for d in deltas]
    chunks.append(stream.on_message(0, pb.StreamResponse(chunk=pb.StreamChunk(index=0, token_ids=[5]))))  # held back
    final = stream.on_message(0, pb.StreamResponse(final=pb.StreamFinal(index=0, finish_reason=4)))
    sent = [c[0]["choices"][0]["delta"] for c in chunks if c]
    assert sent == [
        {"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
    assert final[0]["choices"][0]["finish_reason"] == "tool_calls"
