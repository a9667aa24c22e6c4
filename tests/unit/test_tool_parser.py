"""The incremental tool-call parser: every format, every split of the text gives the same result."""
from __future__ import annotations

import itertools
import json

import pytest

from forge_service.tools.formats import DEFAULT_TOOL_PROMPT, FORMATS_BY_NAME, select_format
from forge_service.tools.parser import ToolCallParser

HERMES = ('I will check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, \\"FR\\" {x}", '
          '"days": [1, 2]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
DEFAULT = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
           '{"arguments": {"tz": "</tool_call>"}, "name": "get_time"}]</tool_call> Done.')
LLAMA = ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {"tz": "a}b"}}'
CASES = {
    "hermes": (HERMES, "I will check.",
               [("get_weather", '{"city": "Paris, \\"FR\\" {x}", "days": [1, 2]}'), ("get_time", "{}")]),
    "default": (DEFAULT, "Done.", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "</tool_call>"}')]),
    "llama3_json": (LLAMA, "", [("get_weather", '{"city": "Paris"}'), ("get_time", '{"tz": "a}b"}')]),
}


def parse(fmt: str, pieces: list[str]):
    """(content, [(id, name, arguments)], calls assembled from the deltas)."""
    counter = itertools.count()
    parser = ToolCallParser(FORMATS_BY_NAME[fmt], lambda: f"call_{next(counter)}")
    content, deltas = [], []
    for piece in pieces:
        text, more = parser.feed(piece)
        content.append(text)
        deltas += more
    text, more = parser.finish()
    content.append(text)
    deltas += more
    assembled: dict[int, list[str]] = {}
    for d in deltas:
        if d.id:  # a call's first piece: id and name, before any argument fragment
            assert d.index == len(assembled) and d.name
            assembled[d.index] = [d.id, d.name, d.arguments]
        else:
            assert not d.name and d.index in assembled
            assembled[d.index][2] += d.arguments
    calls = [(c.id, c.name, c.arguments) for c in parser.calls]
    return "".join(content), calls, [tuple(v) for _, v in sorted(assembled.items())]


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_whole_text(fmt: str) -> None:
    text, content, expected = CASES[fmt]
    got_content, calls, assembled = parse(fmt, [text])
    assert got_content == content
    assert [(n, a) for _, n, a in calls] == expected
    assert [c[0] for c in calls] == ["call_0", "call_1"]
    assert assembled == calls
    for _, _, arguments in calls:
        json.loads(arguments)


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_every_split_gives_the_same_calls_and_content(fmt: str) -> None:
    text = CASES[fmt][0]
    whole = parse(fmt, [text])
    for i in range(len(text) + 1):
        assert parse(fmt, [text[:i], text[i:]]) == whole, i
    for i in range(0, len(text) + 1, 7):  # three pieces
        for j in range(i, len(text) + 1, 5):
            assert parse(fmt, [text[:i], text[i:j], text[j:]]) == whole, (i, j)
    assert parse(fmt, list(text)) == whole  # one character at a time


def test_markup_never_reaches_content_while_streaming() -> None:
    counter = itertools.count()
    parser = ToolCallParser(FORMATS_BY_NAME["hermes"], lambda: f"c{next(counter)}")
    shown = ""
    for ch in HERMES:
        shown += parser.feed(ch)[0]
        assert "<" not in shown and "tool_call" not in shown and "{" not in shown.replace("{x}", "")
    assert shown == "I will check."


def test_text_without_calls_is_all_content_and_a_partial_tag_is_flushed_at_the_end() -> None:
    assert parse("hermes", ["Hello <b>world</b> <tool"]) == ("Hello <b>world</b> <tool", [], [])
    assert parse("llama3_json", ["Paris is {big}"]) == ("Paris is {big}", [], [])


def test_a_call_cut_short_keeps_its_arguments_so_far() -> None:
    content, calls, assembled = parse("hermes", ['<tool_call>\n{"name": "f", "arguments": {"a": [1, 2'])
    assert content == "" and calls == [("call_0", "f", '{"a": [1, 2')] and assembled == calls


def test_arguments_before_name_and_as_a_json_string() -> None:
    text = '<tool_call>{"arguments": "{\\"a\\": 1}", "name": "f"}</tool_call>'
    assert parse("hermes", [text])[1] == [("call_0", "f", '{"a": 1}')]
    assert parse("hermes", list(text)) == parse("hermes", [text])


def test_format_selection_from_the_template() -> None:
    assert select_format(None).name == "default"
    assert select_format("{{ messages }}").name == "default"  # no tools variable: Forge's prompt
    qwen = "{% if tools %}<tools>{{ tools | tojson }}</tools> ... <tool_call>{% endif %}"
    assert select_format(qwen).name == "hermes"
    llama = "{% if tools %}Environment: ipython ... <|python_tag|>{% endif %}"
    assert select_format(llama).name == "llama3_json"
    assert select_format("{% if tools %}{{ tools }}{% endif %}").name == "default"
    assert "<tool_call>" in DEFAULT_TOOL_PROMPT.format(tools="[]")


@pytest.mark.parametrize("fmt", sorted(CASES))
def test_render_calls_round_trips_through_the_parser(fmt: str) -> None:
    calls = [("f", {"a": 1}), ("g", {"b": [True, None]})]
    text = FORMATS_BY_NAME[fmt].render_calls(calls)
    assert [(n, json.loads(a)) for _, n, a in parse(fmt, [text])[1]] == calls


def test_a_call_cut_before_its_arguments_has_none_and_is_not_complete() -> None:
    counter = itertools.count()
    for text, arguments, complete in [('<tool_call>\n{"name": "f"', "", False),
                                      ('<tool_call>\n{"name": "f", "argu', "", False),
                                      ('<tool_call>\n{"name": "f", "arguments": {"a": 1', '{"a": 1', False),
                                      ('<tool_call>\n{"name": "f"}', "{}", True),  # no arguments, closed
                                      ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', '{"a": 1}', True)]:
        for pieces in ([text], list(text)):
            parser = ToolCallParser(FORMATS_BY_NAME["hermes"], lambda: f"call_{next(counter)}")
            for piece in pieces:
                parser.feed(piece)
            parser.finish()
            assert [(c.name, c.arguments, c.complete) for c in parser.calls] == [("f", arguments, complete)], text


def test_a_start_tag_cut_short_is_content_unless_only_calls_can_be_generated() -> None:
    for calls_only, content in ((False, "<tool_c"), (True, "")):
        parser = ToolCallParser(FORMATS_BY_NAME["hermes"], lambda: "call_0", calls_only=calls_only)
        shown = parser.feed("<tool_c")[0]
        assert shown + parser.finish()[0] == content and not parser.calls
