"""Tool-call formats: how a model writes a call, chosen from its chat template.

A format is plain data: the markup around a call region, the JSON key of the arguments,
how several calls are joined, and a test on the chat template's source that recognises it.
The parser, the grammars and the default tool prompt all read these fields, so adding a
format is adding one entry to FORMATS (checked in order; the last, `default`, always matches).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class ToolCallFormat:
    """How calls appear in generated text.

    A call region starts with `start` and ends with `end`; inside it are one or more JSON
    objects `{"name": ..., <arguments_key>: {...}}`. An empty `start` means the region can
    only open at the very beginning of the output, where it runs to the end.
    """

    name: str
    start: str
    end: str
    arguments_key: str
    # Between calls: inside one region when `list_in_region`, else between regions.
    separator: str
    list_in_region: bool
    detect: Callable[[str], bool]

    def render_calls(self, calls: list[tuple[str, Any]]) -> str:
        """The text the model would have written for these (name, arguments object) calls."""
        objects = [json.dumps({"name": n, self.arguments_key: a}, ensure_ascii=False) for n, a in calls]
        if self.list_in_region:
            inner = self.separator.join(objects)
            return f"{self.start}[{inner}]{self.end}" if self.start else inner
        return self.separator.join(f"{self.start}{o}{self.end}" for o in objects)


def _mentions(*needles: str) -> Callable[[str], bool]:
    return lambda source: any(n in source for n in needles)


# Checked in order; `default` matches every template, so it must stay last.
FORMATS: tuple[ToolCallFormat, ...] = (
    # Hermes / Qwen 2.5 / Qwen 3: one object per <tool_call> tag, tags one per line.
    ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", "\n", False,
                   _mentions("<tool_call>")),
    # Llama 3.1 / 3.2 JSON tool calls: the whole answer is `{"name": ..., "parameters": ...}`.
    ToolCallFormat("llama3_json", "", "", "parameters", "; ", True,
                   lambda s: "<|python_tag|>" in s or bool(re.search(r"Environment: ipython", s))),
    # Forge's default, for templates without tool support: one JSON list of calls in one tag,
    # as SmolLM2's function-calling data writes them. Its prompt is DEFAULT_TOOL_PROMPT.
    ToolCallFormat("default", "<tool_call>", "</tool_call>", "arguments", ", ", True, lambda s: True),
)
FORMATS_BY_NAME = {f.name: f for f in FORMATS}

# Forge's default tool prompt, added to the system message when the template has no `tools`.
DEFAULT_TOOL_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible functions. "
    "Based on the question, you will need to make one or more function/tool calls to achieve the purpose. "
    "If none of the functions can be used, answer in plain text.\n\n"
    "You have access to the following tools:\n<tools>{tools}</tools>\n\n"
    "To call tools, write only a JSON list of calls in <tool_call></tool_call> tags, like this:\n"
    "<tool_call>[{{\"name\": \"func_name\", \"arguments\": {{\"arg1\": \"value1\"}}}}]</tool_call>"
)


def uses_tools_variable(template_source: str | None) -> bool:
    """Whether a chat template renders the `tools` variable itself."""
    return bool(template_source) and re.search(r"\btools\b", template_source) is not None


def renders_tools_natively(template_source: str | None) -> bool:
    """Whether Forge passes tools to the template itself: it renders `tools` and its call format is
    a known one. Otherwise Forge's default tool prompt and format are used, so that the format the
    model is told about is the one the parser and the grammar expect."""
    return uses_tools_variable(template_source) and select_format(template_source).name != "default"


def select_format(template_source: str | None, name: str | None = None) -> ToolCallFormat:
    """The format named `name`, else the first whose test matches the template, else `default`.
    A template that cannot render tools always gets `default`, since its prompt is Forge's."""
    if name:
        return FORMATS_BY_NAME[name]
    source = template_source or ""
    if not uses_tools_variable(source):
        return FORMATS_BY_NAME["default"]
    return next(f for f in FORMATS if f.detect(source))
