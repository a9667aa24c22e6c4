"""Proto messages <-> engine types, for the servicer. Pure functions and small accumulators."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from forge_service.engine.request import SamplingParams
from forge_service.errors import InvalidArgument
from forge_service.pb import forge_pb2 as pb
from forge_service.structured.constraint import Constraint

FINISH_REASONS = {
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}


def _f32(value: float) -> float:
    """A proto float widened to Python without float32 noise (0.7, not 0.699999988)."""
    return float(f"{value:.7g}")


def sampling_params(request: pb.GenerateRequest) -> SamplingParams:
    """The request's SamplingParams, with the proto's documented defaults for unset fields."""
    s, t = request.sampling, request.stopping
    if request.top_logprobs and not request.logprobs:
        raise InvalidArgument(f"top_logprobs={request.top_logprobs} needs logprobs=true")
    return SamplingParams(
        n=request.n or 1,
        temperature=_f32(s.temperature) if s.HasField("temperature") else 1.0,
        top_p=_f32(s.top_p) if s.HasField("top_p") else 1.0,
        top_k=s.top_k,
        min_p=_f32(s.min_p),
        presence_penalty=_f32(s.presence_penalty),
        frequency_penalty=_f32(s.frequency_penalty),
        repetition_penalty=_f32(s.repetition_penalty) if s.HasField("repetition_penalty") else 1.0,
        logit_bias={int(k): _f32(v) for k, v in s.logit_bias.items()} or None,
        seed=s.seed if s.HasField("seed") else None,
        max_tokens=t.max_tokens if t.HasField("max_tokens") else None,
        stop=list(t.stop),
        stop_token_ids=list(t.stop_token_ids),
        ignore_eos=t.ignore_eos,
        logprobs=request.top_logprobs if request.logprobs else None,
        include_stop_str_in_output=t.include_stop_str_in_output,
        skip_special_tokens=t.skip_special_tokens if t.HasField("skip_special_tokens") else True,
        constraint=constraint(request),
    )


def constraint(request: pb.GenerateRequest) -> Constraint | None:
    """The request's structured-output constraint (the `constraint` oneof); None when unset."""
    kind = request.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not request.json_object):
        return None
    if kind == "choice":
        return Constraint("choice", json.dumps(list(request.choice.choices)))
    return Constraint(kind, "" if kind == "json_object" else getattr(request, kind))


def prompt_token_ids(request: pb.GenerateRequest, tokenizer: Any, max_model_len: int) -> list[int]:
    """Tokenize the request's input (rendering chat messages with the model's template)."""
    kind = request.WhichOneof("input")
    if kind == "text":
        ids = list(tokenizer.encode(request.text))
    elif kind == "chat":
        if not request.chat.messages:
            raise InvalidArgument("chat.messages is empty")
        ids = list(tokenizer.encode_chat([_message(m) for m in request.chat.messages], add_generation_prompt=True))
    elif kind == "token_ids":
        ids = list(request.token_ids.ids)
        bad = next((i for i in ids if i >= tokenizer.vocab_size), None)
        if bad is not None:
            raise InvalidArgument(f"token_ids has id {bad}, outside the vocabulary [0, {tokenizer.vocab_size})")
    else:
        raise InvalidArgument("the request has no input: set one of text, chat or token_ids")
    if not ids:
        raise InvalidArgument("the prompt is empty")
    if len(ids) >= max_model_len:
        raise InvalidArgument(
            f"the prompt has {len(ids)} tokens, but the model's context length is {max_model_len} and at least "
            f"one token must be generated: shorten the prompt by {len(ids) - max_model_len + 1} tokens")
    return ids


def _message(message: pb.ChatMessage) -> dict[str, str]:
    out = {"role": message.role, "content": message.content}
    if message.name:
        out["name"] = message.name
    return out


def _token_logprob(entry: Any) -> pb.TokenLogprob:
    raw = getattr(entry, "bytes", None)  # the engine's exact bytes when it has them
    return pb.TokenLogprob(token_id=entry.token_id, token=entry.token, logprob=entry.logprob,
                           bytes=raw if raw is not None else entry.token.encode(), rank=entry.rank or 0)


def position_logprobs(per_token: list[list[Any]] | None) -> list[pb.PositionLogprobs]:
    """Engine logprobs ([chosen, *alternatives] per token) as proto messages."""
    return [pb.PositionLogprobs(chosen=_token_logprob(chosen), top=[_token_logprob(t) for t in top])
            for chosen, *top in per_token or []]


def _matched_stop(message: Any, stop_reason: int | str | None) -> None:
    if isinstance(stop_reason, str):
        message.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        message.stop_token_id = stop_reason


class StreamEncoder:
    """Turns one request's delta RequestOutputs into StreamResponse messages."""

    def __init__(self, request_id: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = num_prompt_tokens
        self.completion_tokens: dict[int, int] = {}

    def messages(self, output: Any) -> list[pb.StreamResponse]:
        messages = []
        for completion in output.outputs:
            count = self.completion_tokens.get(completion.index, 0) + len(completion.token_ids)
            self.completion_tokens[completion.index] = count
            if completion.text or completion.token_ids:
                chunk = pb.StreamChunk(index=completion.index, text=completion.text, token_ids=completion.token_ids,
                                       logprobs=position_logprobs(completion.logprobs))
                messages.append(pb.StreamResponse(request_id=self.request_id, chunk=chunk))
            if completion.finish_reason is not None:
                final = self._final(output, completion, count)
                messages.append(pb.StreamResponse(request_id=self.request_id, final=final))
        return messages

    def _final(self, output: Any, completion: Any, count: int) -> pb.StreamFinal:
        usage = pb.Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=count,
                         cached_tokens=output.num_cached_tokens)
        final = pb.StreamFinal(index=completion.index, finish_reason=FINISH_REASONS.get(completion.finish_reason, 0),
                               usage=usage)
        _matched_stop(final, completion.stop_reason)
        return final


@dataclass
class _Choice:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[pb.PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class GenerateAccumulator:
    """Collects one request's delta RequestOutputs into a GenerateResponse."""

    def __init__(self, request_id: str, model: str, num_prompt_tokens: int) -> None:
        self.request_id = request_id
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self.num_cached_tokens = 0
        self.choices: dict[int, _Choice] = {}

    def add(self, output: Any) -> None:
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        for completion in output.outputs:
            choice = self.choices.setdefault(completion.index, _Choice())
            choice.text.append(completion.text)
            choice.token_ids.extend(completion.token_ids)
            choice.logprobs.extend(position_logprobs(completion.logprobs))
            if completion.finish_reason is not None:
                choice.finish_reason, choice.stop_reason = completion.finish_reason, completion.stop_reason

    def response(self) -> pb.GenerateResponse:
        choices = []
        for index in sorted(self.choices):
            c = self.choices[index]
            choice = pb.Choice(index=index, text="".join(c.text), token_ids=c.token_ids, logprobs=c.logprobs,
                               finish_reason=FINISH_REASONS.get(c.finish_reason or "", 0))
            _matched_stop(choice, c.stop_reason)
            choices.append(choice)
        usage = pb.Usage(prompt_tokens=self.num_prompt_tokens, cached_tokens=self.num_cached_tokens,
                         completion_tokens=sum(len(c.token_ids) for c in self.choices.values()))
        return pb.GenerateResponse(request_id=self.request_id, model=self.model, choices=choices, usage=usage)
