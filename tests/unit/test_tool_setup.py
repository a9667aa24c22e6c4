"""Tools from the proto: checks, prompt rendering, output processing; JSON Schema helpers."""
from __future__ import annotations

import json
import logging

import pytest

from forge_service import convert
from forge_service.errors import InvalidArgument
from forge_service.pb import forge_pb2 as pb
from forge_service.structured.schema import OutputValidator, check_schema, close_objects, relax
from forge_service.tokenizer.chat_template import ChatTemplate
from forge_service.tools.output import OutputProcessor
from forge_service.tools.prompt import template_inputs
from forge_service.tools.setup import tool_setup

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
SMOL = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
QWEN_LIKE = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools> use <tool_call>{% endif %}"
             "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% if m.tool_calls %}{% for c in m.tool_calls %}"
             "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}"
             "{% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}")


def request(*messages: pb.ChatMessage, tools=("get_weather",), choice=None, **fields) -> pb.GenerateRequest:
    req = pb.GenerateRequest(chat=pb.ChatInput(messages=list(messages) or [pb.ChatMessage(role="user", content="hi")]),
                             tools=[pb.Tool(name=n, description=f"{n} tool", parameters=json.dumps(WEATHER))
                                    for n in tools], **fields)
    if choice is not None:
        req.tool_choice.CopyFrom(choice)
    return req


@pytest.mark.parametrize("req, words", [
    (request(choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_FUNCTION, function_name="nope")), "not among the tools"),
    (request(tools=(), choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)), "no tools"),
    (request(tools=("a b",)), "name must be"),
    (request(tools=("f", "f")), "used twice"),
    (pb.GenerateRequest(text="x", tools=[pb.Tool(name="f")]), "chat input"),
    (pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x")]),
                        tools=[pb.Tool(name="f", parameters='{"type": "strin"}')]), "invalid JSON Schema"),
    (pb.GenerateRequest(chat=pb.ChatInput(messages=[pb.ChatMessage(role="user", content="x")]),
                        tools=[pb.Tool(name="f", parameters="{not json")]), "not valid JSON"),
    (request(json_schema='{"type": "object"}'), "cannot be combined"),
])
def test_bad_tool_requests_are_invalid_argument(req: pb.GenerateRequest, words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        tool_setup(req, SMOL)


def test_modes_and_constraints() -> None:
    assert tool_setup(pb.GenerateRequest(text="x"), SMOL) is None
    assert tool_setup(pb.GenerateRequest(text="x", tool_choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE)), SMOL) \
        is None
    auto = tool_setup(request(), SMOL)
    assert auto.mode == "auto" and auto.parallel and auto.format.name == "default" and not auto.native_template
    assert json.loads(auto.constraint().spec)["mode"] == "auto"
    named = tool_setup(request(tools=("a", "b"), choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_FUNCTION,
                                                                       function_name="b")), QWEN_LIKE)
    spec = json.loads(named.constraint().spec)
    assert spec["mode"] == "required" and [t["name"] for t in spec["tools"]] == ["b"] and not spec["parallel"]
    assert named.format.name == "hermes" and named.native_template
    none = tool_setup(request(choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE), json_schema="{}"), SMOL)
    assert none.constraint() is None  # none combines with response_format
    assert tool_setup(request(parallel_tool_calls=False), SMOL).parallel is False
    unknown = tool_setup(request(), "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}{% endif %}")
    assert unknown.format.name == "default" and not unknown.native_template  # Forge's prompt, not the template's


def test_strict_tool_parameters_are_closed() -> None:
    req = request()
    req.tools[0].strict = True
    assert tool_setup(req, SMOL).tools[0].parameters["additionalProperties"] is False


def conversation() -> list[pb.ChatMessage]:
    call = pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    return [pb.ChatMessage(role="user", content="Weather in Paris?"),
            pb.ChatMessage(role="assistant", tool_calls=[call]),
            pb.ChatMessage(role="tool", tool_call_id="call_1", content='{"temp": 21}')]


def test_fallback_prompt_for_a_template_without_tools() -> None:
    setup = tool_setup(request(*conversation()), SMOL)
    messages, variables = template_inputs(conversation(), setup, SMOL)
    assert variables == {}
    assert messages[0]["role"] == "system" and "<tools>" in messages[0]["content"]
    assert '"name": "get_weather"' in messages[0]["content"]
    assert messages[2]["content"] == '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    assert messages[3] == {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1", "name": "get_weather"}
    text = ChatTemplate(SMOL).render(messages, **variables)
    assert "<|im_start|>tool\n{\"temp\": 21}<|im_end|>" in text


def test_native_template_gets_tools_and_tool_calls() -> None:
    setup = tool_setup(request(*conversation()), QWEN_LIKE)
    messages, variables = template_inputs(conversation(), setup, QWEN_LIKE)
    assert variables["tools"][0]["function"]["name"] == "get_weather"
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    text = ChatTemplate(QWEN_LIKE).render(messages, **variables)
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "(call_1)" in text and "<tools>" in text


def test_tool_choice_none_leaves_tools_out_of_the_prompt_but_keeps_the_history() -> None:
    setup = tool_setup(request(*conversation(), choice=pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_NONE)), SMOL)
    messages, variables = template_inputs(conversation(), setup, SMOL)
    assert variables == {} and messages[0]["role"] == "user" and "<tool_call>" in messages[1]["content"]


@pytest.mark.parametrize("messages, words", [
    ([pb.ChatMessage(role="tool", tool_call_id="call_9", content="x")], "answers no tool call"),
    ([pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="a", name="f", arguments="[1]")])], "JSON object"),
    ([pb.ChatMessage(role="user", tool_calls=[pb.ToolCall(id="a", name="f")])], "only assistant"),
])
def test_bad_tool_messages(messages, words) -> None:
    with pytest.raises(InvalidArgument, match=words):
        template_inputs(messages, None, SMOL)


def test_output_processor_splits_calls_and_sets_the_finish_reason(caplog) -> None:
    setup = tool_setup(request(), SMOL)
    seen = []
    out = OutputProcessor("r1", setup, on_validated=lambda what, ok: seen.append((what, ok)))
    text = '<tool_call>[{"name": "get_weather", "arguments": {"town": "Paris"}}]</tool_call>'
    pieces = [out.feed(0, text[:20]), out.feed(0, text[20:])]
    with caplog.at_level(logging.WARNING):
        last, calls, reason = out.finish(0, "stop")
    assert "".join(p.text for p in pieces) + last.text == ""
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"town": "Paris"}')] and reason == "tool_calls"
    assert seen == [("tool_call", False)] and "'city' is a required property" in caplog.text
    assert OutputProcessor("r2", setup).finish(0, "length")[2] == "length"


def test_a_call_cut_short_by_max_tokens_is_not_validated(caplog) -> None:
    """A call cut by max_tokens is no schema violation: only the calls that closed are checked."""
    seen = []
    out = OutputProcessor("r4", tool_setup(request(), SMOL), on_validated=lambda what, ok: seen.append((what, ok)))
    out.feed(0, '<tool_call>[{"name": "get_weather", "arguments": {"town": "Paris"}}, '
                '{"name": "get_weather", "arguments": {"city": "Par')
    with caplog.at_level(logging.WARNING):
        last, calls, reason = out.finish(0, "length")
    assert [(c.arguments, c.complete) for c in calls] == [('{"town": "Paris"}', True), ('{"city": "Par', False)]
    assert reason == "length" and seen == [("tool_call", False)]  # the first call only
    assert caplog.text.count("does not match its schema") == 1 and "'city' is a required property" in caplog.text


def test_json_schema_output_is_validated_afterwards(caplog) -> None:
    req = pb.GenerateRequest(text="x", json_schema=json.dumps({"type": "array", "uniqueItems": True}))
    out = convert.output_processor(req, "r3", None)
    out.feed(0, "[1, 1]")
    with caplog.at_level(logging.WARNING):
        assert out.finish(0, "stop")[0].text == ""
    assert "non-unique" in caplog.text


def test_schema_helpers() -> None:
    with pytest.raises(InvalidArgument, match="invalid JSON Schema"):
        check_schema({"type": "object", "properties": {"a": {"minimum": "x"}}})
    check_schema({"oneOf": [{"type": "string"}], "uniqueItems": True, "format": "whatever"})
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {}}},
                                               "c": {"type": "object", "additionalProperties": True}},
              "allOf": [{"properties": {"d": {}}}], "$defs": {"e": {"properties": {"f": {}}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False and closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert "additionalProperties" not in closed["allOf"][0]  # members of allOf stay open
    assert closed["$defs"]["e"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # the input is left as it was
    relaxed, notes = relax({"$ref": "#/$defs/x", "minItems": 2, "description": "d", "$defs": {"x": {}}})
    assert relaxed == {"$ref": "#/$defs/x", "$defs": {"x": {}}} and notes == [
        "keywords beside $ref #/$defs/x ignored: minItems"]
    validator = OutputValidator({"type": "object", "required": ["a"]})
    assert validator.errors('{"a": 1}') == [] and validator.errors("{}") and validator.errors("{")


def test_stream_and_generate_carry_the_same_calls(monkeypatch) -> None:
    """The servicer's encoders: chunks carry content and call pieces, finals and choices the whole calls."""
    from tests.unit.fakes import CompletionOutput, RequestOutput

    setup = tool_setup(request(), SMOL)
    text = 'Checking. <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]

    def outputs():
        for k, piece in enumerate(pieces):
            done = k == len(pieces) - 1
            yield RequestOutput("r", [1], [CompletionOutput(0, piece, [k], finish_reason="stop" if done else None,
                                                            stop_reason=2 if done else None)], done)

    ids = iter(f"call_{i}" for i in range(9))
    monkeypatch.setattr("forge_service.tools.output.new_call_id", lambda: next(ids))
    encoder = convert.StreamEncoder("r", 1, convert.output_processor(request(), "r", setup))
    messages = [m for o in outputs() for m in encoder.messages(o)]
    accumulator = convert.GenerateAccumulator("r", "m", 1, convert.output_processor(request(), "r", setup))
    for o in outputs():
        accumulator.add(o)
    [choice] = accumulator.response().choices
    assert choice.text == "Checking." and choice.finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert [(c.name, c.arguments) for c in choice.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    chunks = [m.chunk for m in messages if m.HasField("chunk")]
    assert "".join(c.text for c in chunks) == "Checking."
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].name == "get_weather" and deltas[0].id == "call_0"
    assert "".join(d.arguments for d in deltas) == '{"city": "Paris"}'
    final = messages[-1].final
    assert final.finish_reason == pb.FINISH_REASON_TOOL_CALLS and final.tool_calls[0].arguments == '{"city": "Paris"}'
    assert sum(len(c.token_ids) for c in chunks) == len(pieces)


def test_with_calls_required_a_start_tag_cut_by_max_tokens_is_not_content() -> None:
    required = pb.ToolChoice(mode=pb.TOOL_CHOICE_MODE_REQUIRED)
    for choice, content in ((None, "<tool_c"), (required, "")):  # auto may write text; required only calls
        out = OutputProcessor("r5", tool_setup(request(choice=choice), SMOL))
        piece = out.feed(0, "<tool_c")
        last, calls, reason = out.finish(0, "length")
        assert piece.text + last.text == content and not calls and reason == "length"
