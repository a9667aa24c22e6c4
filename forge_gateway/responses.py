"""OpenAI's Responses API (POST /v1/responses) on the chat path.

A request becomes the chat request it means: `input` items become messages (a function_call item
an assistant message's tool call, a function_call_output item a tool message), `instructions` a
system message first, `text.format` the response_format, function tools the tools. The chat
answer becomes a Response: a reasoning item with a thinking model's thought (see
forge_service/reasoning.py), a message item with its output_text, then a function_call item per
call; streaming, the Responses events (response.created, output_item.added,
reasoning_text.delta, output_text.delta, function_call_arguments.delta, ..., response.completed).
A reasoning input item goes with the assistant message or call after it. Forge keeps no
responses, so `previous_response_id` and `background` are refused: send the conversation as
`input`. Only function tools and text input exist here.
"""
from __future__ import annotations

import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from forge_gateway import convert
from forge_gateway.errors import GatewayError
from forge_gateway.models import _CONFIG, _INT32, ChatCompletionRequest
from forge_service.pb import forge_pb2 as pb

_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = ("user", "system", "developer", "assistant")
# Chat parameters -> the Responses parameters they came from (for an error's param).
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


class TextFormat(BaseModel):
    model_config = ConfigDict(**_CONFIG, populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("type 'json_schema' needs a name and a schema")
        return self


class TextConfig(BaseModel):
    model_config = _CONFIG

    format: TextFormat | None = None


class FunctionChoice(BaseModel):
    model_config = _CONFIG

    type: Literal["function"]
    name: str


class FunctionTool(BaseModel):
    model_config = _CONFIG

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="after")
    def _function(self) -> FunctionTool:
        if self.type != "function":
            raise ValueError(f"tools of type {self.type!r} are not supported; only 'function'")
        if not self.name:
            raise ValueError("a function tool needs a name")
        return self


class ResponsesRequest(BaseModel):
    model_config = _CONFIG

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=_INT32)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["disabled"] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    priority: int = Field(0, ge=-(2**31), le=_INT32)  # vLLM's: the rank under priority scheduling

    @field_validator("previous_response_id")
    @classmethod
    def _stateless(cls, value: str | None) -> None:
        if value is not None:
            raise ValueError("not supported: Forge keeps no responses; send the whole conversation as input")

    @field_validator("background")
    @classmethod
    def _in_the_foreground(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported")
        return value


# ---- requests ------------------------------------------------------------------------

def chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request a Responses request means; GatewayError 400 for input it cannot hold."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else [])
    messages += _messages(req.input)
    body: dict[str, Any] = {"model": req.model, "messages": messages, "stream": req.stream}
    for name in ("temperature", "top_p", "parallel_tool_calls", "user", "seed", "priority"):
        if getattr(req, name) is not None:
            body[name] = getattr(req, name)
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, **{k: v for k, v in (("description", t.description), ("parameters", t.parameters),
                                                  ("strict", t.strict)) if v is not None}}} for t in req.tools]
    if isinstance(req.tool_choice, FunctionChoice):
        body["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        body["tool_choice"] = req.tool_choice
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name, "schema": fmt.schema_, **({"strict": fmt.strict} if fmt.strict is not None else {})}}
    return ChatCompletionRequest.model_validate(body)


def _messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    thought: tuple[int, str] | None = None  # a reasoning item's (index, text), for its turn's assistant message
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if thought is not None and not (kind == "function_call" or item.get("role") == "assistant"):
            raise _bad(thought[0], "a reasoning item comes just before its turn's assistant message or function call")
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise _bad(i, f"a message's role is one of {', '.join(_ROLES)}, not {item.get('role')!r}")
            messages.append({"role": item["role"], "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if thought is None and last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the turn's text or calls before it: one turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _text(item.get("output"), i)})
        elif kind == "reasoning":
            thought = (i, _reasoning_text(item, i))
            continue
        else:
            raise _bad(i, f"input items of type {kind!r} are not supported; only message, function_call, "
                          f"function_call_output and reasoning")
        if thought is not None:
            messages[-1]["reasoning"] = thought[1]
            thought = None
    if thought is not None:
        raise _bad(thought[0], "a reasoning item comes just before its turn's assistant message or function call")
    return messages


def _reasoning_text(item: dict[str, Any], i: int) -> str:
    """A reasoning item's thought: its reasoning_text content, else its summary's text."""
    parts = item.get("content") or item.get("summary") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in parts):
        raise _bad(i, "a reasoning item's content is a list of reasoning_text parts")
    return "".join(p["text"] for p in parts)


def _text(content: Any, i: int) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(i, "content is a string or a list of input_text parts")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise _bad(i, f"content parts of type {kind!r} are not supported; only input_text and output_text")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise _bad(i, f"a {item.get('type')} item needs a string {key}")
    return value


def _bad(i: int, message: str) -> GatewayError:
    return GatewayError(400, f"input[{i}]: {message}", param=f"input[{i}]", code="invalid_value")


def renamed(error: GatewayError) -> GatewayError:
    """An error of the chat request, its param named as in the Responses request (a message's
    index is not its item's: instructions and grouped calls shift them, so `input` alone)."""
    if error.param:
        head, dot, rest = error.param.partition(".")
        if head in _PARAMS:
            error.param = _PARAMS[head] + (dot + rest if rest and head != "messages" else "")
    return error


# ---- responses -----------------------------------------------------------------------

def _echo(req: ResponsesRequest) -> dict[str, Any]:
    """The request's settings, as a Response repeats them."""
    return {"instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {}, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None}, "store": False,
            # Unset: null, as the server fills in the model's recommended value or its own default.
            "temperature": req.temperature,
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                     if req.text is not None and req.text.format is not None else {"type": "text"}},
            "tool_choice": (req.tool_choice.model_dump() if isinstance(req.tool_choice, FunctionChoice)
                            else req.tool_choice or "auto"),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_p": req.top_p, "truncation": "disabled", "user": req.user}


def _usage(u: Any) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _status(message: Any) -> tuple[str, dict[str, str] | None]:
    """(status, incomplete_details) of a finished choice; GatewayError 500 for a failed one."""
    if convert.finish_reason(message) == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status != "in_progress" \
        else []
    return {"id": item_id, "type": "message", "status": status, "role": "assistant", "content": content}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "content": content}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response(resp: pb.GenerateResponse, response_id: str, created: int, req: ResponsesRequest) -> dict[str, Any]:
    """The Response object for a whole (non-streamed) chat answer."""
    choice = resp.choices[0]
    status, incomplete = _status(choice)
    output = [_reasoning_item(_item_id("rs"), choice.reasoning, "completed")] if choice.reasoning else []
    output += [_message_item(_item_id("msg"), choice.text, "completed")] if choice.text or not choice.tool_calls else []
    output += [_call_item(_item_id("fc"), c.id, c.name, c.arguments, "completed") for c in choice.tool_calls]
    return {"id": response_id, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": incomplete, "model": resp.model or req.model, "output": output, **_echo(req),
            "usage": _usage(resp.usage)}


class ResponsesStream:
    """Stream messages of one chat completion -> the Responses API's events (SSE `event:` named
    by their type, no `[DONE]`): a streams.StreamFormatter."""

    named_events = True
    done_marker = False

    def __init__(self, response_id: str, created: int, req: ResponsesRequest) -> None:
        self.response_id, self.created, self.model, self.req = response_id, created, req.model, req
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the output item being streamed
        self.text = ""
        self.status: tuple[str, dict[str, str] | None] = ("in_progress", None)
        self.final_usage: dict[str, Any] | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": f"response.{kind}", "sequence_number": self.sequence - 1, **fields}

    def _response(self) -> dict[str, Any]:
        status, incomplete = self.status
        return {"id": self.response_id, "object": "response", "created_at": self.created, "status": status,
                "error": None, "incomplete_details": incomplete, "model": self.model, "output": list(self.output),
                **_echo(self.req), "usage": self.final_usage}

    def start(self, first: pb.StreamResponse) -> list[dict[str, Any]]:
        return [self._event(kind, response=self._response()) for kind in ("created", "in_progress")]

    def on_message(self, prompt: int, message: pb.StreamResponse) -> list[dict[str, Any]]:
        if not message.HasField("chunk"):
            final = message.final
            self.status = _status(final)
            self.final_usage = _usage(final.usage)
            # An empty answer is an empty message, as a whole response has it.
            answered = any(item["type"] != "reasoning" for item in self.output) or (
                self.open is not None and self.open["type"] != "reasoning")
            return self._close() + (self._open_message() if not answered else []) + self._close()
        events: list[dict[str, Any]] = []
        if message.chunk.reasoning:
            if self.open is None or self.open["type"] != "reasoning":
                events += self._close() + self._open(_reasoning_item(_item_id("rs"), "", "in_progress"))
            self.text += message.chunk.reasoning
            events.append(self._event("reasoning_text.delta", item_id=self.open["id"], output_index=len(self.output),
                                      content_index=0, delta=message.chunk.reasoning))
        if message.chunk.text:
            if self.open is None or self.open["type"] != "message":
                events += self._close() + self._open_message()
            self.text += message.chunk.text
            events.append(self._event("output_text.delta", item_id=self.open["id"], output_index=len(self.output),
                                      content_index=0, delta=message.chunk.text, logprobs=[]))
        for delta in message.chunk.tool_calls:
            if delta.id:  # a call's first piece
                call = _call_item(_item_id("fc"), delta.id, delta.name, "", "in_progress")
                events += self._close() + self._open(call)
            if delta.arguments and self.open is not None:
                self.open["arguments"] += delta.arguments
                events.append(self._event("function_call_arguments.delta", item_id=self.open["id"],
                                          output_index=len(self.output), delta=delta.arguments))
        return events

    def end(self) -> list[dict[str, Any]]:
        done = "completed" if self.status[0] == "completed" else "incomplete"
        return self._close() + [self._event(done, response=self._response())]

    def _open_message(self) -> list[dict[str, Any]]:
        events = self._open(_message_item(_item_id("msg"), "", "in_progress"))
        return events + [self._event("content_part.added", item_id=self.open["id"], output_index=len(self.output),
                                     content_index=0, part={"type": "output_text", "text": "", "annotations": []})]

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.open, self.text = item, ""
        return [self._event("output_item.added", output_index=len(self.output), item=dict(item))]

    def _close(self) -> list[dict[str, Any]]:
        item, at = self.open, len(self.output)
        if item is None:
            return []
        self.open = None
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            done = _message_item(item["id"], self.text, "completed")
            events = [self._event("output_text.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=self.text, logprobs=[]),
                      self._event("content_part.done", item_id=item["id"], output_index=at, content_index=0, part=part)]
        elif item["type"] == "reasoning":
            done = _reasoning_item(item["id"], self.text, "completed")
            events = [self._event("reasoning_text.done", item_id=item["id"], output_index=at, content_index=0,
                                  text=self.text)]
        else:
            done = {**item, "status": "completed"}
            events = [self._event("function_call_arguments.done", item_id=item["id"], output_index=at,
                                  arguments=item["arguments"])]
        self.output.append(done)
        return events + [self._event("output_item.done", output_index=at, item=done)]
