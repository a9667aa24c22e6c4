"""Chat templates: jinja2 in an immutable sandbox, with the semantics of transformers' apply_chat_template.

Same environment options (trim_blocks, lstrip_blocks, loop controls, `{% generation %}`), the same
`tojson` (no HTML escaping, non-ASCII kept), `raise_exception` and `strftime_now`, so a template renders
byte-for-byte as it does under transformers.
"""
from __future__ import annotations

import functools
import json
import os
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from forge_service.errors import InvalidArgument, StartupError


_CONTENT_END = "\ue004"  # a private-use character: marks the end of a message to be continued


class TemplateRaised(jinja2.exceptions.TemplateError):
    """A template called `raise_exception(msg)`: the conversation is not one it accepts."""


def _raise_exception(message: str) -> None:
    raise TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


@functools.lru_cache(maxsize=64)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once; later calls with the same source reuse it."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise InvalidArgument(f"chat template does not compile: {e}") from e


def read_chat_template(value: str) -> str:
    """A server's own chat template (--chat-template), in place of the model's: the text of the file
    `value` names, or `value` itself when it is a Jinja template (it holds `{{` or `{%`).
    StartupError when it is neither, cannot be read, or does not compile."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                source = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise StartupError(f"chat_template: cannot read {value}: {e}") from e
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise StartupError(f"chat_template: {value!r} is neither a file nor a Jinja template")
    if not source.strip():
        raise StartupError(f"chat_template: {value} is empty")
    try:
        compile_template(source)
    except InvalidArgument as e:
        raise StartupError(f"chat_template: {e}") from e
    return source


class ChatTemplate:
    """A compiled chat template plus the special-token variables (`bos_token`, ...) it may read."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.template = compile_template(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, continue_final_message: bool = False,
               **kwargs: Any) -> str:
        """The prompt text. Extra kwargs (`tools`, `documents`, template flags) override special tokens.

        continue_final_message: the text ends where the last message's content does (the template's
        end-of-message tokens and anything after them cut), so that the model goes on writing it."""
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidArgument("continue_final_message cannot be combined with add_generation_prompt")
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise InvalidArgument("continue_final_message needs a last message with text content")
            # A mark after the content shows where the template wrote its end, whatever it wraps it in.
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTENT_END}]
        text = self._render(messages, add_generation_prompt, {**self.special_tokens, "tools": None, "documents": None,
                                                              **kwargs})
        if not continue_final_message:
            return text
        end = text.rfind(_CONTENT_END)
        if end < 0:
            raise InvalidArgument("the chat template does not write the last message's content, so it cannot be "
                                  "continued")
        return text[:end]

    def _render(self, messages: list[dict], add_generation_prompt: bool, variables: dict[str, Any]) -> str:
        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        except TemplateRaised as e:
            raise InvalidArgument(f"chat template rejected the conversation: {e}") from e
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as e:
            # Undefined attributes, wrong content types etc. come from the request's messages.
            raise InvalidArgument(f"chat template failed to render: {type(e).__name__}: {e}") from e

