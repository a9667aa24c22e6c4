"""Proto messages <-> engine types, for the servicer. Pure functions and small accumulators."""
from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

from forge_service import reasoning
from forge_service.engine.request import SamplingParams
from forge_service.errors import CONTEXT_LENGTH_EXCEEDED, ForgeError, InvalidArgument, blame
from forge_service.pb import forge_pb2 as pb
from forge_service.structured.constraint import Constraint
from forge_service.structured.schema import close_objects
from forge_service.tools.output import OutputProcessor
from forge_service.tools.prompt import template_inputs
from forge_service.tools.setup import ToolSetup, tool_setup

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "tool_calls": pb.FINISH_REASON_TOOL_CALLS,
}


# SamplingParams' attributes that do not come from sampling.<name>: the GenerateRequest field each does.
_REQUEST_FIELDS = {"n": "n", "max_tokens": "stopping.max_tokens", "min_tokens": "stopping.min_tokens",
                   "stop": "stopping.stop",
                   "stop_token_ids": "stopping.stop_token_ids", "logprobs": "top_logprobs",
                   "num_speculative_tokens": "num_speculative_tokens", "prompt_logprobs": "prompt_logprobs",
                   "priority": "priority"}
_SAMPLING_FIELDS = {f.name for f in pb.SamplingParameters.DESCRIPTOR.fields}


@contextlib.contextmanager
def request_fields() -> Iterator[None]:
    """Errors of SamplingParams' checks, which name an attribute as their field, name the
    GenerateRequest field it came from instead (temperature -> sampling.temperature)."""
    try:
        yield
    except ForgeError as error:
        if error.field in _REQUEST_FIELDS:
            error.field = _REQUEST_FIELDS[error.field]
        elif error.field in _SAMPLING_FIELDS:
            error.field = f"sampling.{error.field}"
        raise


def _f32(value: float) -> float:
    """A proto float widened to Python without float32 noise (0.7, not 0.699999988)."""
    return float(f"{value:.7g}")


def tools(request: pb.GenerateRequest, tokenizer: Any) -> ToolSetup | None:
    """The request's checked tools (None without any), in the tool-call format of the model's template."""
    return tool_setup(request, getattr(tokenizer, "chat_template", None))


def output_processor(request: pb.GenerateRequest, request_id: str, setup: ToolSetup | None, tokenizer: Any = None,
                     prompt: Sequence[int] = (), reasoning_parser: str = "off") -> OutputProcessor:
    """Reasoning split off (chat input, as `reasoning_parser` and the model's template say),
    tool-call parsing and the after-the-fact schema check for one request's outputs."""
    schema = None
    if request.WhichOneof("constraint") == "json_schema":
        schema = _json_schema(request)
    # A grammar (structured output, or calls required) shapes the whole text: it has no thought.
    constrained = request.WhichOneof("constraint") is not None or (
        setup is not None and setup.mode in ("required", "function"))
    split = request.WhichOneof("input") == "chat" and not constrained and reasoning.parses_reasoning(
        reasoning_parser, getattr(tokenizer, "chat_template", None))
    # whether the template opened the thought itself: the prompt's last tokens, special ones kept
    tail = tokenizer.decode(list(prompt[-16:]), skip_special_tokens=False) if split else ""
    in_thought = reasoning.prompt_opens_thought(tail)
    include = not request.HasField("include_reasoning") or request.include_reasoning
    return OutputProcessor(request_id, setup, schema, reasoning=split, in_thought=in_thought, include_reasoning=include,
                           close_token=reasoning.close_token(tokenizer) if split else None)


def sampling_params(request: pb.GenerateRequest, setup: ToolSetup | None = None,
                    defaults: dict[str, float | int] | None = None) -> SamplingParams:
    """The request's SamplingParams. An unset field takes `defaults`' value (the model's), else the
    proto's documented default."""
    s, t = request.sampling, request.stopping
    defaults = defaults or {}

    def given(name: str, forge_default: float | int) -> float | int:
        value = getattr(s, name) if s.HasField(name) else defaults.get(name, forge_default)
        return value if name == "top_k" else _f32(value)

    if request.top_logprobs and not request.logprobs:
        raise InvalidArgument(f"top_logprobs={request.top_logprobs} needs logprobs=true", field="top_logprobs")
    return SamplingParams(
        n=request.n or 1,
        temperature=given("temperature", 1.0),
        top_p=given("top_p", 1.0),
        top_k=given("top_k", 0),
        min_p=given("min_p", 0.0),
        presence_penalty=_f32(s.presence_penalty),
        frequency_penalty=_f32(s.frequency_penalty),
        repetition_penalty=given("repetition_penalty", 1.0),
        logit_bias={int(k): _f32(v) for k, v in s.logit_bias.items()} or None,
        bad_words=list(s.bad_words) or None,
        allowed_token_ids=list(s.allowed_token_ids) or None,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=t.max_tokens if t.HasField("max_tokens") else None,
        min_tokens=t.min_tokens,
        stop=list(t.stop),
        stop_token_ids=list(t.stop_token_ids),
        ignore_eos=t.ignore_eos,
        logprobs=request.top_logprobs if request.logprobs else None,
        prompt_logprobs=request.prompt_logprobs if request.HasField("prompt_logprobs") else None,
        include_stop_str_in_output=t.include_stop_str_in_output,
        skip_special_tokens=t.skip_special_tokens if t.HasField("skip_special_tokens") else True,
        constraint=setup.constraint() if setup is not None and setup.calls_allowed else constraint(request),
        num_speculative_tokens=request.num_speculative_tokens if request.HasField("num_speculative_tokens") else None,
        priority=request.priority,
    )


def constraint(request: pb.GenerateRequest) -> Constraint | None:
    """The request's structured-output constraint (the `constraint` oneof); None when unset."""
    kind = request.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not request.json_object):
        return None
    with blame(kind):
        if kind == "choice":
            return Constraint("choice", json.dumps(list(request.choice.choices)))
        if kind == "json_schema" and request.json_schema_strict:
            schema = _json_schema(request)
            return Constraint(kind, json.dumps(close_objects(schema)) if schema is not None else request.json_schema)
        return Constraint(kind, "" if kind == "json_object" else getattr(request, kind))


def _json_schema(request: pb.GenerateRequest) -> Any | None:
    """The json_schema constraint parsed (strict closing applied); None when it is not JSON (the
    compiler reports that)."""
    try:
        schema = json.loads(request.json_schema)
    except (json.JSONDecodeError, RecursionError):
        return None
    return close_objects(schema) if request.json_schema_strict else schema


def prediction_token_ids(request: pb.GenerateRequest, tokenizer: Any, max_model_len: int) -> list[int]:
    """The predicted output's tokens, as many as an output can have (the context's)."""
    return list(tokenizer.encode(request.prediction, add_special_tokens=False))[:max_model_len]


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: Any, max_model_len: int,
                     setup: ToolSetup | None = None) -> list[int]:
    """Tokenize the request's input (rendering chat messages with the model's template); refused
    when it leaves no room in the context for one generated token."""
    ids = input_token_ids(request, tokenizer, setup)
    if request.HasField("truncate_prompt_tokens"):
        ids = ids[-_kept_prompt_tokens(request.truncate_prompt_tokens, max_model_len):]
    if len(ids) >= max_model_len:
        raise InvalidArgument(
            f"the prompt has {len(ids)} tokens, but the model's context length is {max_model_len} and at least "
            f"one token must be generated: shorten the prompt by {len(ids) - max_model_len + 1} tokens",
            kind=CONTEXT_LENGTH_EXCEEDED)
    return ids


def _kept_prompt_tokens(truncate: int, max_model_len: int) -> int:
    if truncate == -1:
        return max_model_len - 1
    if not 1 <= truncate < max_model_len:
        raise InvalidArgument(f"truncate_prompt_tokens must be -1 or from 1 to {max_model_len - 1} (the context "
                              f"length - 1), got {truncate}", field="truncate_prompt_tokens")
    return truncate


def input_token_ids(request: pb.GenerateRequest, tokenizer: Any, setup: ToolSetup | None = None) -> list[int]:
    """The request's input as token ids, whatever its length."""
    kind = request.WhichOneof("input")
    if kind == "text":
        ids = list(tokenizer.encode(request.text))
    elif kind == "chat":
        if not request.chat.messages:
            raise InvalidArgument("chat.messages is empty")
        messages, variables = template_inputs(request.chat.messages, setup, getattr(tokenizer, "chat_template", None))
        ids = list(tokenizer.encode_chat(messages, **_template_flags(request.chat), **variables,
                                         **_template_kwargs(request.chat)))
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        check_vocabulary(ids, tokenizer.vocab_size, "token_ids has id")
    else:
        raise InvalidArgument("the request has no input: set one of text, chat or token_ids")
    if not ids:
        raise InvalidArgument("the prompt is empty")
    return ids


def _template_flags(chat: pb.ChatInput) -> dict[str, bool]:
    """How the template ends the prompt: the generation prompt, or the last message left open."""
    continuing = chat.continue_final_message
    adding = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else not continuing
    if continuing:
        if adding:
            raise InvalidArgument("continue_final_message cannot be combined with add_generation_prompt: true",
                                  field="chat.add_generation_prompt")
        last, at = chat.messages[-1], len(chat.messages) - 1
        if last.role != "assistant" or last.tool_calls:
            raise InvalidArgument(f"continue_final_message continues the last message, which must be an assistant's "
                                  f"text without tool_calls; messages[{at}] is not", field=f"chat.messages[{at}]")
    return {"add_generation_prompt": adding, "continue_final_message": continuing}


# Template variables a request's chat_template_kwargs may not set: the server's own.
_RESERVED_VARIABLES = {"messages", "tools", "documents", "add_generation_prompt", "continue_final_message",
                       "chat_template", "raise_exception", "strftime_now"}


def _template_kwargs(chat: pb.ChatInput) -> dict[str, Any]:
    if not chat.chat_template_kwargs:
        return {}
    try:
        kwargs = json.loads(chat.chat_template_kwargs)
    except (json.JSONDecodeError, RecursionError) as error:
        raise InvalidArgument(f"chat_template_kwargs is not JSON: {error}",
                              field="chat.chat_template_kwargs") from None
    if not isinstance(kwargs, dict):
        raise InvalidArgument("chat_template_kwargs must be a JSON object", field="chat.chat_template_kwargs")
    reserved = sorted(k for k in kwargs if k in _RESERVED_VARIABLES or k.endswith("_token"))
    if reserved:
        raise InvalidArgument(f"chat_template_kwargs cannot set {', '.join(reserved)}: the server passes them",
                              field="chat.chat_template_kwargs")
    return kwargs


def check_vocabulary(ids: Iterable[int], vocab_size: int, what: str, field: str | None = None) -> None:
    """InvalidArgument "<what> <id>, outside the vocabulary [0, vocab_size)" for the first id past it."""
    bad = next((i for i in ids if i >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"{what} {bad}, outside the vocabulary [0, {vocab_size})", field=field)


def detokenized(request: pb.DetokenizeRequest, tokenizer: Any) -> str:
    """The text of a Detokenize request's token ids."""
    check_vocabulary(request.token_ids, tokenizer.vocab_size, "token_ids has id", field="token_ids")
    skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
    return tokenizer.decode(list(request.token_ids), skip_special_tokens=skip)


def _token_logprob(entry: Any) -> pb.TokenLogprob:
    raw = getattr(entry, "bytes", None)  # the engine's exact bytes when it has them
    return pb.TokenLogprob(token_id=entry.token_id, token=entry.token, logprob=entry.logprob,
                           bytes=raw if raw is not None else entry.token.encode(), rank=entry.rank or 0)


def first_prompt_token(tokenizer: Any, token_id: int) -> pb.TokenLogprob:
    """A prompt's first token as prompt logprobs show it: its id, text and bytes, no logprob."""
    return pb.TokenLogprob(token_id=token_id, token=tokenizer.decode([token_id], skip_special_tokens=False),
                           bytes=tokenizer.token_bytes(token_id))


def prompt_logprobs(per_token: list[list[Any] | None], first: pb.TokenLogprob | None) -> pb.PromptLogprobs:
    """The engine's prompt logprobs (None for the first token, then [chosen, *alternatives])."""
    return pb.PromptLogprobs(positions=position_logprobs(per_token[1:]), first=first)


def position_logprobs(per_token: list[list[Any]] | None) -> list[pb.PositionLogprobs]:
    """Engine logprobs ([chosen, *alternatives] per token) as proto messages."""
    return [pb.PositionLogprobs(chosen=_token_logprob(chosen), top=[_token_logprob(t) for t in top])
            for chosen, *top in per_token or []]


def _matched_stop(message: Any, stop_reason: int | str | None) -> None:
    if isinstance(stop_reason, str):
        message.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        message.stop_token_id = stop_reason


def _tool_call(call: Any) -> pb.ToolCall:
    return pb.ToolCall(id=call.id, name=call.name, arguments=call.arguments)


def _tool_call_delta(delta: Any) -> pb.ToolCallDelta:
    return pb.ToolCallDelta(index=delta.index, id=delta.id, name=delta.name, arguments=delta.arguments)


class StreamEncoder:
    """Turns one request's delta RequestOutputs into StreamResponse messages."""

    def __init__(self, request_id: str, num_prompt_tokens: int, processor: OutputProcessor | None = None,
                 first_prompt_token: pb.TokenLogprob | None = None) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.first_prompt_token = first_prompt_token
        self.completion_tokens: dict[int, int] = {}
        self.processor = processor or OutputProcessor(request_id, None)

    def messages(self, output: Any) -> list[pb.StreamResponse]:
        messages = []
        if output.prompt_logprobs is not None:  # on the request's first delta, before its tokens
            prompt = prompt_logprobs(output.prompt_logprobs, self.first_prompt_token)
            messages.append(pb.StreamResponse(request_id=self.request_id, prompt_logprobs=prompt))
        for completion in output.outputs:
            count = self.completion_tokens.get(completion.index, 0) + len(completion.token_ids)
            self.completion_tokens[completion.index] = count
            piece = self.processor.feed(completion.index, completion.text, completion.token_ids)
            if piece.text or completion.token_ids or piece.tool_calls or piece.reasoning:
                messages.append(self._chunk(completion.index, piece, completion.token_ids,
                                            position_logprobs(completion.logprobs)))
            if completion.finish_reason is not None:
                last, calls, reason = self.processor.finish(completion.index, completion.finish_reason)
                if last.text or last.tool_calls or last.reasoning:
                    messages.append(self._chunk(completion.index, last, [], []))
                final = self._final(output, completion, count, reason, calls)
                messages.append(pb.StreamResponse(request_id=self.request_id, final=final))
        return messages

    def _chunk(self, index: int, piece: Any, token_ids: list[int], logprobs: list[pb.PositionLogprobs]
               ) -> pb.StreamResponse:
        chunk = pb.StreamChunk(index=index, text=piece.text, token_ids=token_ids, logprobs=logprobs,
                               tool_calls=[_tool_call_delta(d) for d in piece.tool_calls], reasoning=piece.reasoning,
                               prompt_tokens=self.num_prompt_tokens)
        return pb.StreamResponse(request_id=self.request_id, chunk=chunk)

    def _final(self, output: Any, completion: Any, count: int, reason: str | None, calls: list[Any]
               ) -> pb.StreamFinal:
        usage = pb.Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=count,
                         cached_tokens=output.num_cached_tokens, draft_tokens=completion.num_drafted_tokens,
                         accepted_draft_tokens=completion.num_accepted_tokens,
                         reasoning_tokens=self.processor.reasoning_tokens(completion.index))
        final = pb.StreamFinal(index=completion.index, finish_reason=FINISH_REASONS.get(reason or "", 0),
                               usage=usage, tool_calls=[_tool_call(c) for c in calls])
        _matched_stop(final, completion.stop_reason)
        return final


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    tool_calls: list[Any] = field(default_factory=list)
    draft_tokens: int = 0  # speculative decoding, cumulative in every delta
    accepted_draft_tokens: int = 0


class GenerateAccumulator:
    """Collects one request's delta RequestOutputs into a GenerateResponse."""

    def __init__(self, request_id: str, model: str, num_prompt_tokens: int,
                 processor: OutputProcessor | None = None, first_prompt_token: pb.TokenLogprob | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.first_prompt_token = first_prompt_token
        self.prompt_logprobs: pb.PromptLogprobs | None = None
        self.choices: dict[int, _Choice] = {}
        self.processor = processor or OutputProcessor(request_id, None)

    def add(self, output: Any) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs(output.prompt_logprobs, self.first_prompt_token)
        for completion in output.outputs:
            choice = self.choices.setdefault(completion.index, _Choice())
            piece = self.processor.feed(completion.index, completion.text, completion.token_ids)
            choice.text.append(piece.text)
            choice.reasoning.append(piece.reasoning)
            choice.token_ids.extend(completion.token_ids)
            choice.logprobs.extend(position_logprobs(completion.logprobs))
            choice.draft_tokens = max(choice.draft_tokens, completion.num_drafted_tokens)
            choice.accepted_draft_tokens = max(choice.accepted_draft_tokens, completion.num_accepted_tokens)
            if completion.finish_reason is not None:
                last, calls, reason = self.processor.finish(completion.index, completion.finish_reason)
                choice.text.append(last.text)
                choice.reasoning.append(last.reasoning)
                choice.tool_calls = calls
                choice.finish_reason, choice.stop_reason = reason, completion.stop_reason

    def response(self) -> pb.GenerateResponse:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            choice = pb.Choice(index=index, text="".join(c.text), token_ids=c.token_ids, logprobs=c.logprobs,
                               finish_reason=FINISH_REASONS.get(c.finish_reason or "", 0),
                               tool_calls=[_tool_call(t) for t in c.tool_calls], reasoning="".join(c.reasoning))
            _matched_stop(choice, c.stop_reason)
            choices.append(choice)
        usage = pb.Usage(prompt_tokens=self.num_prompt_tokens, cached_tokens=self.num_cached_tokens,
                         completion_tokens=sum(len(c.token_ids) for c in self.choices.values()),
                         draft_tokens=sum(c.draft_tokens for c in self.choices.values()),
                         accepted_draft_tokens=sum(c.accepted_draft_tokens for c in self.choices.values()),
                         reasoning_tokens=sum(map(self.processor.reasoning_tokens, self.choices)))
        return pb.GenerateResponse(request_id=self.request_id, model=self.model, choices=choices, usage=usage,
                                   prompt_logprobs=self.prompt_logprobs)
