"""OpenAI's Responses API in the gateway: requests become chat requests, chat answers become
Response objects and Responses events; through a fake service with the official client."""
from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from forge_gateway import responses
from forge_gateway.errors import GatewayError
from forge_service.pb import forge_pb2 as pb
from tests.unit.test_gateway import FakeForge, client, fake, http, stack  # noqa: F401 (fixtures)

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}


def request(**fields: Any) -> responses.ResponsesRequest:
    return responses.ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_input_items_become_chat_messages() -> None:
    items = [{"role": "developer", "content": "be brief"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                             {"type": "input_text", "text": "in Paris?"}]},
             {"role": "assistant", "content": "Let me look."},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
             {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "21 C"},
             {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "25 C"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Warm."}]}]
    chat = responses.chat_request(request(input=items, instructions="You are Forge.", max_output_tokens=20,
                                          temperature=0.5, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False))
    message = [(m.role, m.text(), [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls or []],
                m.tool_call_id) for m in chat.messages]
    assert message == [
        ("system", "You are Forge.", [], None), ("developer", "be brief", [], None),
        ("user", "Weather in Paris?", [], None),
        ("assistant", "Let me look.", [("call_1", "get_weather", '{"city": "Paris"}'),
                                       ("call_2", "get_weather", '{"city": "Rome"}')], None),
        ("tool", "21 C", [], "call_1"), ("tool", "25 C", [], "call_2"), ("assistant", "Warm.", [], None)]
    assert (chat.max_tokens, chat.temperature, chat.tool_choice, chat.parallel_tool_calls) == (20, 0.5, "required", False)
    [tool] = chat.tools
    assert (tool.function.name, tool.function.parameters, tool.function.strict) == (
        "get_weather", WEATHER["parameters"], True)


def test_text_format_and_a_named_function_map_to_the_chat_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = responses.chat_request(request(text={"format": {"type": "json_schema", "name": "s", "schema": schema,
                                                           "strict": True}},
                                          tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}))
    assert chat.response_format.json_schema.schema_ == schema and chat.response_format.json_schema.strict
    assert chat.tool_choice.function.name == "get_weather"
    assert responses.chat_request(request(text={"format": {"type": "json_object"}})).response_format.type == \
        "json_object"
    assert responses.chat_request(request(text={"format": {"type": "text"}})).response_format is None


def test_a_priority_reaches_the_chat_request() -> None:
    assert responses.chat_request(request(priority=-2)).priority == -2
    assert responses.chat_request(request()).priority == 0


@pytest.mark.parametrize("items, words", [
    ([{"type": "reasoning", "summary": []}], "a reasoning item comes just before its turn's assistant message"),
    ([{"type": "reasoning", "content": [{"type": "reasoning_text", "text": "t"}]}, {"role": "user", "content": "q"}],
     "a reasoning item comes just before its turn's assistant message"),
    ([{"type": "reasoning", "content": "t"}], "a reasoning item's content is a list of reasoning_text parts"),
    ([{"type": "web_search_call"}], "input items of type 'web_search_call' are not supported"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "'input_image' are not supported"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "needs a string call_id"),
])
def test_input_it_cannot_hold_is_a_400_naming_the_item(items: list, words: str) -> None:
    with pytest.raises(GatewayError) as error:
        responses.chat_request(request(input=items))
    assert error.value.status == 400 and words in error.value.message and error.value.param == "input[0]"


def test_a_reasoning_item_goes_with_the_assistant_message_or_call_after_it() -> None:
    thought = {"type": "reasoning", "id": "rs_1", "summary": [],
               "content": [{"type": "reasoning_text", "text": "Look it "}, {"type": "reasoning_text", "text": "up."}]}
    items = [{"role": "user", "content": "Weather?"}, thought,
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
             {"role": "assistant", "content": "Before"},
             {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Say it."}]},
             {"role": "assistant", "content": "Warm."}]
    chat = responses.chat_request(request(input=items, tools=[WEATHER]))
    assert [(m.role, m.text(), m.reasoning, len(m.tool_calls or [])) for m in chat.messages] == [
        ("user", "Weather?", None, 0), ("assistant", "", "Look it up.", 1), ("tool", "21 C", None, 0),
        ("assistant", "Before", None, 0), ("assistant", "Warm.", "Say it.", 0)]


def test_a_thought_becomes_a_reasoning_item_first_whole_and_streamed() -> None:
    answer = pb.GenerateResponse(choices=[pb.Choice(text="Four.", reasoning="Two and two.",
                                                    finish_reason=pb.FINISH_REASON_STOP)])
    thought, message = responses.response(answer, "r", 0, request())["output"]
    assert thought["type"] == "reasoning" and thought["id"].startswith("rs_")
    assert thought["content"] == [{"type": "reasoning_text", "text": "Two and two."}] and thought["summary"] == []
    assert message["content"][0]["text"] == "Four."
    chunks = [pb.StreamChunk(reasoning="Two and "), pb.StreamChunk(reasoning="two."), pb.StreamChunk(text="Four.")]
    events = stream_events([pb.StreamResponse(chunk=c) for c in chunks]
                           + [pb.StreamResponse(final=pb.StreamFinal(finish_reason=pb.FINISH_REASON_STOP))])
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created", "in_progress", "output_item.added", "reasoning_text.delta", "reasoning_text.delta",
        "reasoning_text.done", "output_item.done", "output_item.added", "content_part.added", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done", "completed"]
    assert events[5]["text"] == "Two and two." and events[3]["output_index"] == 0 and events[9]["output_index"] == 1
    done = events[-1]["response"]["output"]
    assert [(i["type"], i["content"][0]["text"]) for i in done] == [("reasoning", "Two and two."), ("message", "Four.")]
    # a thought cut short by max_output_tokens: the thought, then an empty message, as a whole response has it
    cut = stream_events([pb.StreamResponse(chunk=chunks[0]),
                         pb.StreamResponse(final=pb.StreamFinal(finish_reason=pb.FINISH_REASON_LENGTH))])
    whole = responses.response(pb.GenerateResponse(choices=[pb.Choice(reasoning="Two and ",
                                                                      finish_reason=pb.FINISH_REASON_LENGTH)]),
                               "r", 0, request())
    assert [(i["type"], i["content"][0]["text"]) for i in cut[-1]["response"]["output"]] == [
        ("reasoning", "Two and "), ("message", "")] == [(i["type"], i["content"][0]["text"]) for i in whole["output"]]


def test_a_whole_answer_becomes_a_response() -> None:
    call = pb.ToolCall(id="call_a", name="get_weather", arguments='{"city": "Paris"}')
    answer = pb.GenerateResponse(model="m", usage=pb.Usage(prompt_tokens=7, completion_tokens=5, cached_tokens=2),
                                 choices=[pb.Choice(text="Let me look.", finish_reason=pb.FINISH_REASON_TOOL_CALLS,
                                                    tool_calls=[call])])
    out = responses.response(answer, "resp_1", 100, request(tools=[WEATHER], metadata={"k": "v"}))
    assert (out["id"], out["object"], out["status"], out["incomplete_details"]) == ("resp_1", "response", "completed",
                                                                                   None)
    message, function_call = out["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me look."
    assert {k: function_call[k] for k in ("type", "call_id", "name", "arguments", "status")} == {
        "type": "function_call", "call_id": "call_a", "name": "get_weather", "arguments": '{"city": "Paris"}',
        "status": "completed"}
    assert out["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 5,
                            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 12}
    assert out["metadata"] == {"k": "v"} and out["tools"] == [WEATHER] and out["store"] is False
    cut = pb.GenerateResponse(choices=[pb.Choice(text="abc", finish_reason=pb.FINISH_REASON_LENGTH)])
    assert responses.response(cut, "r", 0, request())["incomplete_details"] == {"reason": "max_output_tokens"}


def stream_events(messages: list[pb.StreamResponse]) -> list[dict[str, Any]]:
    stream = responses.ResponsesStream("resp_1", 100, request(tools=[WEATHER]))
    events = stream.start(messages[0])
    for message in messages:
        events += stream.on_message(0, message)
    return events + stream.end()


def test_a_stream_becomes_the_responses_events_in_order() -> None:
    chunks = [pb.StreamChunk(text="Let "), pb.StreamChunk(text="me look."),
              pb.StreamChunk(tool_calls=[pb.ToolCallDelta(index=0, id="call_a", name="get_weather",
                                                          arguments='{"city":')]),
              pb.StreamChunk(tool_calls=[pb.ToolCallDelta(index=0, arguments=' "Paris"}'),
                                         pb.ToolCallDelta(index=1, id="call_b", name="get_time", arguments="{}")])]
    final = pb.StreamFinal(finish_reason=pb.FINISH_REASON_TOOL_CALLS, usage=pb.Usage(prompt_tokens=3,
                                                                                    completion_tokens=9))
    events = stream_events([pb.StreamResponse(chunk=c) for c in chunks] + [pb.StreamResponse(final=final)])
    assert [e["type"].removeprefix("response.") for e in events] == [
        "created", "in_progress",
        "output_item.added", "content_part.added", "output_text.delta", "output_text.delta",
        "output_text.done", "content_part.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.delta",
        "function_call_arguments.done", "output_item.done",
        "output_item.added", "function_call_arguments.delta", "function_call_arguments.done", "output_item.done",
        "completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    done = events[-1]["response"]
    assert done["status"] == "completed" and done["usage"]["output_tokens"] == 9
    assert [(i["type"], i.get("arguments")) for i in done["output"]] == [
        ("message", None), ("function_call", '{"city": "Paris"}'), ("function_call", "{}")]
    assert done["output"][0]["content"][0]["text"] == "Let me look."
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []


def test_an_empty_answer_streams_as_an_empty_message_as_a_whole_response_has_it() -> None:
    final = pb.StreamFinal(finish_reason=pb.FINISH_REASON_STOP)
    streamed = stream_events([pb.StreamResponse(final=final)])[-1]["response"]["output"]
    whole = responses.response(pb.GenerateResponse(choices=[pb.Choice(finish_reason=pb.FINISH_REASON_STOP)]), "r", 0,
                               request())["output"]
    assert [(i["type"], i["content"][0]["text"]) for i in streamed] == [("message", "")] == \
        [(i["type"], i["content"][0]["text"]) for i in whole]


def test_a_stream_cut_by_max_output_tokens_ends_incomplete() -> None:
    final = pb.StreamFinal(finish_reason=pb.FINISH_REASON_LENGTH)
    events = stream_events([pb.StreamResponse(chunk=pb.StreamChunk(text="abc")), pb.StreamResponse(final=final)])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


# ---- through the gateway, with the official client ---------------------------------------

def test_the_openai_client_creates_a_response(client: openai.OpenAI, fake: FakeForge) -> None:
    out = client.responses.create(model="fake-model", input="hello", instructions="be brief", max_output_tokens=40,
                                  temperature=0.5)
    assert out.output_text == "echo hello 0" and out.status == "incomplete"  # the fake ends on length
    assert out.id.startswith("resp_") and out.usage.input_tokens == 5 and out.usage.output_tokens == 12
    [sent] = fake.requests
    assert [(m.role, m.content) for m in sent.chat.messages] == [("system", "be brief"), ("user", "hello")]
    assert (sent.stopping.max_tokens, sent.sampling.temperature) == (40, 0.5)


def test_the_openai_client_streams_a_response(client: openai.OpenAI, fake: FakeForge) -> None:
    events = list(client.responses.create(model="fake-model", input="hello", stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "echo hello 0" and len(deltas) == 4  # the fake's 3-character chunks
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert events[-1].response.output_text == "echo hello 0"


def test_the_openai_client_reads_the_reasoning_item(client: openai.OpenAI, fake: FakeForge) -> None:
    out = client.responses.create(model="fake-model", input="think first")
    assert out.output[0].type == "reasoning" and out.output[0].content[0].text == "thought 0 about think first"
    assert out.usage.output_tokens_details.reasoning_tokens == len("thought 0 about think first")
    assert out.output_text == "echo think first 0"
    events = list(client.responses.create(model="fake-model", input="think first", stream=True))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        "thought 0 about think first"


def test_the_stream_names_its_events_and_has_no_done_marker(http: httpx.Client, fake: FakeForge) -> None:
    response = http.post("/v1/responses", json={"model": "fake-model", "input": "hi", "stream": True})
    lines = [line for line in response.iter_lines() if line]
    names, data = lines[0::2], lines[1::2]
    assert all(n.startswith("event: response.") for n in names) and "data: [DONE]" not in lines
    assert [n.removeprefix("event: ") for n in names] == [json.loads(d[6:])["type"] for d in data]


@pytest.mark.parametrize("body, param, words", [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "Forge keeps no responses"),
    ({"background": True}, "background", "background responses are not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools.0", "only 'function'"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0]", "'item_reference' are not supported"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0]", "role is one of user, system"),
    ({"input": [{"role": "user"}]}, "input[0]", "content is a string or a list"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
])
def test_requests_it_cannot_serve_are_400_naming_the_parameter(http: httpx.Client, fake: FakeForge, body: dict,
                                                                param: str, words: str) -> None:
    response = http.post("/v1/responses", json={"model": "fake-model", "input": "hi", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] and error["param"] == param, error
    assert not fake.requests


def test_a_service_error_names_the_responses_parameter(http: httpx.Client, fake: FakeForge) -> None:
    response = http.post("/v1/responses", json={"model": "fake-model", "input": "too-long"})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "input"  # the service's chat field, by its Responses name
