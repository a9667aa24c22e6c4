"""Tool calling with the official `openai` client against `forge serve` on the default model.

SmolLM2's template has no `tools`, so these run Forge's default tool prompt and format; the
format registry and grammars of the others are covered by the unit tests.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import jsonschema
import openai
import pytest

from forge_service.pb import forge_pb2 as pb
from tests.integration.serving.servers import ForgeProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 128
# Sampled small-model arguments can run on (digits of a number, a string that never closes) until
# max_tokens; bounded numbers and strings keep every call finishing, so each one can be validated.
CITY = {"type": "string", "maxLength": 40}


def function(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": name, "description": description, "strict": True,
        "parameters": {"type": "object", "properties": properties, "required": required}}}


WEATHER = function("get_weather", "Get the current weather in a city",
                   {"city": CITY, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   ["city"])
TIME = function("get_time", "Get the current time in a time zone", {"timezone": CITY}, ["timezone"])
CONVERT = function("convert_currency", "Convert an amount of money",
                   {"amount": {"type": "integer", "minimum": 0, "maximum": 1000000}, "source": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "target": {"type": "string", "pattern": "^[A-Z]{3}$"}}, ["amount", "source", "target"])
SEARCH = function("search_books", "Search a library catalogue",
                  {"query": {"type": "string", "maxLength": 60}, "year": {"type": "integer", "minimum": 1400, "maximum": 2100},
                   "tags": {"type": "array", "items": CITY, "maxItems": 3}}, ["query"])
TOOLS = [WEATHER, TIME, CONVERT, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTIONS = [
    "What's the weather like in Paris today?",
    "What time is it in Tokyo right now?",
    "How much is 250 US dollars in euros?",
    "Find me books about the history of Rome published after 1990.",
    "Is it raining in London?",
    "Convert 99.5 GBP to JPY please.",
    "What is the time in New York?",
    "Look for science fiction books with robots.",
    "Tell me the temperature in Berlin in fahrenheit.",
    "I need the current time in Sydney and the weather there.",
]


def ask(question: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": question}]


def check_calls(message: Any, finish_reason: str, only: str | None = None) -> int:
    """Every call names a tool and its arguments parse and validate; returns how many."""
    assert finish_reason == "tool_calls", (finish_reason, message)
    assert message.content is None and message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
        assert only is None or call.function.name == only
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return len(message.tool_calls)


def test_required_and_named_calls_always_validate(client: openai.OpenAI, model: str) -> None:
    """At least 50 sampled calls, all sent at once (one batch): every one parses and validates."""
    def required(question: str, seed: int) -> int:
        r = client.chat.completions.create(model=model, messages=ask(question), tools=TOOLS, tool_choice="required",
                                           n=3, temperature=0.7, seed=seed, max_tokens=MAX_TOKENS)
        return sum(check_calls(c.message, c.finish_reason) for c in r.choices)

    def named(question: str, seed: int) -> int:
        name = TOOLS[seed % len(TOOLS)]["function"]["name"]
        r = client.chat.completions.create(model=model, messages=ask(question), tools=TOOLS, n=3, seed=seed,
                                           tool_choice={"type": "function", "function": {"name": name}},
                                           temperature=0.7, max_tokens=MAX_TOKENS)
        counts = [check_calls(c.message, c.finish_reason, only=name) for c in r.choices]
        assert counts == [1, 1, 1]  # a named choice is exactly one call
        return sum(counts)

    with ThreadPoolExecutor(2 * len(QUESTIONS)) as pool:
        futures = [pool.submit(fn, q, i) for i, q in enumerate(QUESTIONS) for fn in (required, named)]
        total = sum(f.result() for f in futures)
    assert total >= 60


def stream_calls(client: openai.OpenAI, **kwargs: Any) -> tuple[str | None, list[tuple[str, str]], str, list]:
    """(content, [(name, arguments)], finish_reason, chunks) assembled from a stream's deltas."""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    content, calls, finish = None, {}, None
    for chunk in chunks:
        [choice] = chunk.choices
        if choice.delta.content:
            content = (content or "") + choice.delta.content
        for d in choice.delta.tool_calls or []:
            if d.id:  # the first piece: id, type and name, before any arguments
                assert d.index not in calls and d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, d.function.arguments or ""]
            else:
                assert d.function.name is None
                calls[d.index][1] += d.function.arguments
        finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish, chunks


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}},
                                         "auto", "none"])
def test_stream_assembles_to_the_whole_response(client: openai.OpenAI, model: str, tool_choice: Any) -> None:
    kwargs = dict(model=model, messages=ask(QUESTIONS[9]), tools=TOOLS, tool_choice=tool_choice, temperature=0,
                  max_tokens=MAX_TOKENS)
    whole = client.chat.completions.create(**kwargs).choices[0]
    content, calls, finish, chunks = stream_calls(client, **kwargs)
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert (content, calls, finish) == (whole.message.content, expected, whole.finish_reason)
    if tool_choice == "none":
        assert not calls and whole.finish_reason in ("stop", "length")
    elif tool_choice != "auto":
        assert calls and finish == "tool_calls"
    for chunk in chunks:  # no markup leaks into content
        assert "<tool_call>" not in (chunk.choices[0].delta.content or "")


def test_auto_can_answer_in_text_or_call(client: openai.OpenAI, model: str) -> None:
    text = client.chat.completions.create(model=model, messages=ask("Say hello to me in French."),
                                          tools=[WEATHER], tool_choice="auto", temperature=0, max_tokens=24)
    called = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": "Always use the tools when they help."},
                               *ask("What's the weather like in Paris today?")],
        tools=TOOLS, temperature=0, max_tokens=MAX_TOKENS)  # tool_choice defaults to auto
    for choice in (text.choices[0], called.choices[0]):
        assert "<tool_call>" not in (choice.message.content or "")
        if choice.message.tool_calls:
            check_calls(choice.message, choice.finish_reason)
    assert text.choices[0].message.content


def test_round_trip_call_result_answer(client: openai.OpenAI, model: str) -> None:
    messages = ask("What's the weather like in Paris today?")
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=MAX_TOKENS).choices[0]
    check_calls(first.message, first.finish_reason)
    call = first.message.tool_calls[0]
    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "sunny"})}]
    final = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=48).choices[0]
    assert final.message.tool_calls is None and final.message.content
    assert final.finish_reason in ("stop", "length")


def test_parallel_tool_calls(client: openai.OpenAI, model: str) -> None:
    """An earlier turn with two calls shows the way; with parallel_tool_calls off the grammar allows one."""
    def call(i: int, city: str) -> dict[str, Any]:
        return {"id": f"call_{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}

    messages = [*ask("What's the weather in Paris and in Rome?"),
                {"role": "assistant", "content": None, "tool_calls": [call(1, "Paris"), call(2, "Rome")]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_2", "content": "cloudy"},
                {"role": "assistant", "content": "Paris is sunny and Rome is cloudy."},
                *ask("And what's the weather in Berlin and in Madrid?")]
    kwargs = dict(model=model, messages=messages, tools=TOOLS, tool_choice="required", n=4, temperature=0.7, seed=3,
                  max_tokens=2 * MAX_TOKENS)
    several = client.chat.completions.create(**kwargs)
    counts = [check_calls(c.message, c.finish_reason) for c in several.choices]
    assert max(counts) >= 2, counts
    single = client.chat.completions.create(parallel_tool_calls=False, **kwargs)
    assert [check_calls(c.message, c.finish_reason) for c in single.choices] == [1, 1, 1, 1]


@pytest.mark.parametrize("fields, words", [
    ({"tools": [function("f", "", {"a": {"type": "strin"}}, [])]}, "invalid JSON Schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the tools"),
    ({"tool_choice": "required"}, "no tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "1"}],
      "tools": [WEATHER]}, "answers no tool call"),
])
def test_bad_tool_requests_are_400(client: openai.OpenAI, model: str, fields: dict[str, Any], words: str) -> None:
    kwargs = {"messages": ask("hi"), **fields}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=model, max_tokens=8, **kwargs)
    assert error.value.status_code == 400 and words in error.value.message


def test_grpc_clients_get_the_same_calls(server: ForgeProcess) -> None:
    tool = pb.Tool(name="get_time", description="Get the time in a time zone",
                   parameters=json.dumps(SCHEMAS["get_time"]), strict=True)
    request = pb.GenerateRequest(
        chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content=QUESTIONS[1])]), tools=[tool],
        tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED), sampling=pb.SamplingParameters(temperature=0),
        stopping=pb.StoppingParameters(max_tokens=MAX_TOKENS))
    [choice] = server.stub.Generate(request, timeout=120).choices
    assert choice.finish_reason == pb.FINISH_REASON_TOOL_CALLS and choice.text == ""
    [call] = choice.tool_calls
    jsonschema.validate(json.loads(call.arguments), SCHEMAS["get_time"])
    messages = list(server.stub.Stream(request, timeout=120))
    pieces = [d for m in messages if m.HasField("chunk") for d in m.chunk.tool_calls]
    assert pieces[0].name == "get_time" and "".join(p.arguments for p in pieces) == call.arguments
    assert [(c.name, c.arguments) for c in messages[-1].final.tool_calls] == [(call.name, call.arguments)]
    with pytest.raises(grpc.RpcError) as error:
        server.stub.Generate(pb.GenerateRequest(text="x", tools=[tool]), timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
