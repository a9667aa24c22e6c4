"""OpenAI request bodies (pydantic). Ranges the service checks itself are only typed here, so
that every range error reads the same whichever door a request came in by."""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from forge_gateway.tools import MessageToolCall, ToolChoice, ToolDef

_INT32 = 2**31 - 1
# The most alternatives a position's logprobs may list (the service's bound, checked here too so
# that a completion's error names `logprobs`, which the service receives as top_logprobs).
MAX_LOGPROBS = 20
# Strict: a value of the wrong JSON type is a 400, never coerced ("3" is not an integer).
# Unknown fields are kept (not dropped) so that limits.check_request can bound their size.
_CONFIG = ConfigDict(extra="allow", strict=True)
TokenId = Annotated[int, Field(ge=0, le=_INT32)]


class TextPart(BaseModel):
    model_config = _CONFIG

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> TextPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"content parts of type {self.type!r} are not supported; only 'text'")
        return self


def _joined(content: str | list[TextPart] | None) -> str:
    """Content's text: the string, or its text parts joined."""
    if isinstance(content, list):
        return "".join(part.text or "" for part in content)
    return content or ""


class ChatMessage(BaseModel):
    model_config = _CONFIG

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required (validated even when left out) except in an assistant message that calls tools.
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    # assistant: the thought before its content, as Forge (and vLLM, DeepSeek) return it
    reasoning: str | None = None
    reasoning_content: str | None = None

    @field_validator("content")
    @classmethod
    def _content_given(cls, content: str | list[TextPart] | None, info: ValidationInfo) -> str | list[TextPart] | None:
        role = info.data.get("role")
        if content is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content")
        return content

    @model_validator(mode="after")
    def _assistant_says_something(self) -> ChatMessage:
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    def text(self) -> str:
        return _joined(self.content)


class Prediction(BaseModel):
    """OpenAI's predicted output: text the answer will repeat for the most part (a file being
    edited). Drafting proposes from it; it changes no output, only how fast it comes."""

    model_config = _CONFIG

    type: Literal["content"]
    content: str | list[TextPart]

    def text(self) -> str:
        return _joined(self.content)


class StreamOptions(BaseModel):
    model_config = _CONFIG

    include_usage: bool = False
    # vLLM's: with include_usage, every chunk with choices carries the usage so far as well.
    continuous_usage_stats: bool = False


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema. The schema is always enforced; `strict: true` also closes its
    objects (no properties beyond the declared ones unless additionalProperties says so)."""

    model_config = ConfigDict(**_CONFIG, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # `schema` would shadow a BaseModel attribute; the alias keeps OpenAI's JSON name.
    schema_: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _CONFIG

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # vLLM's structural tags: free text in which each trigger opens one of the structures whose
    # begin starts with it ({begin, schema, end}: the begin, JSON the schema admits, the end).
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with name and schema")
        if self.type == "structural_tag" and (not self.structures or not self.triggers):
            raise ValueError("type 'structural_tag' needs structures ({begin, schema, end} objects) and triggers")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` (its guided_* fields' successor): one constraint, and options.
    Unknown keys are refused, not ignored: a constraint left out silently would be unconstrained
    output that looks like success."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    # `json` would shadow a BaseModel attribute; the alias keeps vLLM's JSON name.
    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")  # a JSON Schema
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None  # GBNF or Lark
    json_object: bool | None = None
    structural_tag: str | None = None  # JSON text: {"structures": [...], "triggers": [...]}
    whitespace_pattern: str | None = None
    # Objects without additionalProperties admit only their declared properties (strict mode).
    disable_additional_properties: bool = False
    # Forge's JSON output has fixed separators and no free whitespace whichever value this has.
    disable_any_whitespace: bool = False
    disable_fallback: bool = False  # one grammar backend serves every request: nothing to fall back to

    @model_validator(mode="after")
    def _one(self) -> StructuredOutputs:
        if self.whitespace_pattern is not None:
            raise ValueError("whitespace_pattern is not supported")
        asked = self.kinds()
        if len(asked) != 1:
            raise ValueError(f"exactly one of json, regex, choice, grammar, json_object or structural_tag must be set, got "
                             f"{', '.join(asked) or 'none'}")
        return self

    def kinds(self) -> list[str]:
        """The constraints set, by vLLM's names."""
        values = {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                  "json_object": self.json_object or None, "structural_tag": self.structural_tag}
        return [name for name, value in values.items() if value is not None]


class _Common(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI + vLLM extensions)."""

    model_config = _CONFIG

    model: str
    n: int = Field(1, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = Field(None, ge=-1, le=_INT32)
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=_INT32)
    bad_words: list[str] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Each prompt token's logprob given those before it, with this many alternatives (whole
    # responses only): completions return them per choice, chat once per response.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # vLLM's: keep only the prompt's last N tokens (-1: as many as the context leaves room for).
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=_INT32)
    # Scheduling rank on a server with priority scheduling: lower runs first (vLLM's extension).
    priority: int = Field(0, ge=-(2**31), le=_INT32)
    # Speculative decoding where the server runs it: the most tokens drafted per step; 0 opts out.
    num_speculative_tokens: int | None = Field(None, ge=0, le=64)
    prediction: Prediction | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_*
    # fields (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None  # a JSON Schema (object or JSON text)
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None  # GBNF or Lark

    @model_validator(mode="after")
    def _one_constraint(self) -> _Common:
        asked = [name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, name) is not None]
        if self.structured_outputs is not None:
            asked.insert(0, "structured_outputs")
        if self.response_format is not None and self.response_format.type != "text":
            asked.insert(0, "response_format")
        if len(asked) > 1:
            raise ValueError(f"at most one structured output constraint may be set, got {', '.join(asked)}")
        return self

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("stream_options can only be set with stream: true")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.lstrip("-").isdigit() or not 0 <= int(key) <= _INT32:
                raise ValueError(f"keys must be token ids (non-negative integers), got {key!r}")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative(cls, value: list[int] | None) -> list[int] | None:
        if any(not 0 <= t <= _INT32 for t in value or []):
            raise ValueError("token ids must be non-negative integers")
        return value

    def constraint_param(self, param: str | None) -> str | None:
        """An error's param as this request spelt it: the service names a constraint by its kind,
        which the gateway reads as response_format or guided_*; with structured_outputs it is
        structured_outputs.<kind>."""
        so = self.structured_outputs
        if so is not None and param in ("response_format", "guided_regex", "guided_choice", "guided_grammar"):
            return f"structured_outputs.{so.kinds()[0]}"
        if self.guided_json is not None and param == "response_format":
            return "guided_json"
        return param

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


_REFUSED_CHAT_FIELDS = {
    "functions": " (the deprecated form of tools): send tools",
    "function_call": " (the deprecated form of tool_choice): send tools and tool_choice",
    "audio": ": the model answers in text",
    "web_search_options": ": Forge runs no web search",
    "chat_template": ": a request cannot bring its own template; the model's is used (chat_template_kwargs "
                     "sets its variables)",
}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=_INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's template controls: the model goes on writing the last message (an assistant's, whose
    # text the client began: a prefill) instead of starting a new one; the generation prompt
    # (unset: added, unless continuing).
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None
    # vLLM's: extra variables for the model's chat template (e.g. a Llama 3 template's date_string).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's chat echo: each answer begins with the last message's text when that is an
    # assistant's (with continue_final_message, the whole answer).
    echo: bool = False
    # vLLM's: false leaves a thinking model's thought out of the answer (it is split off either way).
    include_reasoning: bool | None = None
    # Modalities other than text are refused (the model answers in text alone).
    modalities: list[Literal["text"]] | None = None

    # OpenAI fields Forge cannot honour: refused by name, since ignoring them would answer something
    # else than was asked (no function call, no audio, no search).
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    web_search_options: Any = None
    chat_template: Any = None

    @field_validator("functions", "function_call", "audio", "web_search_options", "chat_template")
    @classmethod
    def _not_served(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            raise ValueError(f"not supported{_REFUSED_CHAT_FIELDS[info.field_name]}")
        return value

    @model_validator(mode="after")
    def _supported(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def echoed(self) -> str:
        """The text `echo` puts before each answer: the last message's, when it is an assistant's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == "assistant" else ""

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


Prompt = str | list[str] | list[TokenId] | list[list[TokenId]]


class CompletionRequest(_Common):
    prompt: Prompt
    # 0 with echo: the prompt alone comes back (scored, with logprobs), as OpenAI's legacy API allows.
    max_tokens: int | None = Field(16, ge=0, le=_INT32)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # The prompt begins each completion's text (and its logprobs, with logprobs: the first token's
    # is null); the prompt's logprobs are computed for it, a prompt's way to be scored.
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _supported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported")
        if not self.prompts():
            raise ValueError("prompt is empty")
        return self

    @property
    def prompt_only(self) -> bool:
        """echo with max_tokens 0: each choice is its prompt alone."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[str | list[int]]:
        """Each prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
