"""OpenAI JSON <-> forge.v1 protos: requests become GenerateRequests; whole responses become
OpenAI's chat.completion and text_completion objects (stream messages: streams.py)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from forge_gateway import tools
from forge_gateway.errors import GatewayError
from forge_gateway.models import ChatCompletionRequest, CompletionRequest, StructuredOutputs, _Common
from forge_service.pb import forge_pb2 as pb

# Every finish reason a client may see, as OpenAI spells it. Any other (the server aborted the
# completion, or sent none) is a server-side failure: a 5xx, or an `error` event mid-stream.
FINISH_REASONS = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
                  pb.FINISH_REASON_TOOL_CALLS: "tool_calls"}
# OpenAI's "developer" role is its newer name for "system"; chat templates know "system".
_ROLES = {"developer": "system"}


# ---- requests ------------------------------------------------------------------------

def _sampling(req: _Common) -> pb.SamplingParameters:
    sampling = pb.SamplingParameters(
        presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
        logit_bias={int(k): v for k, v in (req.logit_bias or {}).items()}, bad_words=req.bad_words or [],
        allowed_token_ids=req.allowed_token_ids or [])
    # Unset ones stay unset: the service fills in the model's defaults, or its own.
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed"):
        if getattr(req, name) is not None:
            setattr(sampling, name, getattr(req, name))
    return sampling


def _stopping(req: _Common, max_tokens: int | None) -> pb.StoppingParameters:
    stopping = pb.StoppingParameters(
        stop=req.stop_list, stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens, include_stop_str_in_output=req.include_stop_str_in_output,
        skip_special_tokens=req.skip_special_tokens)
    if max_tokens is not None:
        stopping.max_tokens = max_tokens
    return stopping


def _scheduling(req: _Common) -> dict[str, Any]:
    """How the request is run: its priority, its prompt's truncation, its drafting."""
    fields: dict[str, Any] = {"priority": req.priority}
    if req.truncate_prompt_tokens is not None:
        fields["truncate_prompt_tokens"] = req.truncate_prompt_tokens
    if req.num_speculative_tokens is not None:
        fields["num_speculative_tokens"] = req.num_speculative_tokens
    if req.prediction is not None:
        fields["prediction"] = req.prediction.text()
    return fields


def constraint(req: _Common) -> dict[str, Any]:
    """The structured-output constraint as GenerateRequest fields (the `constraint` oneof); {} for none.
    Schemas travel as JSON text; the service compiles and validates them."""
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        return {"json_object": True}
    if fmt is not None and fmt.type == "json_schema":
        return _schema_fields(fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict))
    if fmt is not None and fmt.type == "structural_tag":
        return {"structural_tag": json.dumps({"structures": fmt.structures, "triggers": fmt.triggers})}
    if req.structured_outputs is not None:
        return _structured_outputs(req.structured_outputs)
    if req.guided_json is not None:
        return _schema_fields(req.guided_json)
    if req.guided_regex is not None:
        return {"regex": req.guided_regex}
    if req.guided_choice is not None:
        return {"choice": pb.ChoiceList(choices=req.guided_choice)}
    if req.guided_grammar is not None:
        return {"grammar": req.guided_grammar}
    return {}


def _schema_fields(schema: dict[str, Any] | bool | str, strict: bool = False) -> dict[str, Any]:
    """A JSON Schema given as an object or as JSON text."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return {"json_schema": text, "json_schema_strict": strict} if strict else {"json_schema": text}


def _structured_outputs(so: StructuredOutputs) -> dict[str, Any]:
    if so.json_ is not None:
        return _schema_fields(so.json_, strict=so.disable_additional_properties)
    if so.json_object:
        return {"json_object": True}
    if so.choice is not None:
        return {"choice": pb.ChoiceList(choices=so.choice)}
    if so.structural_tag is not None:
        return {"structural_tag": so.structural_tag}
    return {"regex": so.regex} if so.regex is not None else {"grammar": so.grammar}


def _prompt_logprobs(req: _Common, echo: int | None = None) -> dict[str, Any]:
    """How many alternatives the service returns per prompt token, if any: vLLM's prompt_logprobs
    (whole responses only, as vLLM has them), or what `echo` shows (its logprobs), the larger."""
    if req.prompt_logprobs is not None and req.stream:
        raise GatewayError(400, "prompt_logprobs cannot be streamed", param="prompt_logprobs")
    wanted = [k for k in (req.prompt_logprobs, echo) if k is not None]
    return {"prompt_logprobs": max(wanted)} if wanted else {}


def chat_request(req: ChatCompletionRequest, request_id: str) -> pb.GenerateRequest:
    messages = [pb.ChatMessage(role=_ROLES.get(m.role, m.role), content=m.text(), name=m.name or "",
                               reasoning=m.reasoning or m.reasoning_content or "",
                               **tools.message_fields(m.tool_calls, m.tool_call_id)) for m in req.messages]
    chat = pb.ChatInput(messages=messages, continue_final_message=req.continue_final_message,
                        chat_template_kwargs=json.dumps(req.chat_template_kwargs) if req.chat_template_kwargs else "")
    if req.add_generation_prompt is not None:
        chat.add_generation_prompt = req.add_generation_prompt
    include = {} if req.include_reasoning is None else {"include_reasoning": req.include_reasoning}
    return pb.GenerateRequest(
        model=req.model, request_id=request_id, chat=chat, n=req.n, **include,
        sampling=_sampling(req), stopping=_stopping(req, req.output_limit),
        logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0, **constraint(req),
        **tools.request_fields(req.tools, req.tool_choice, req.parallel_tool_calls), **_scheduling(req),
        **_prompt_logprobs(req))


def completion_requests(req: CompletionRequest, request_id: str) -> list[pb.GenerateRequest]:
    """One GenerateRequest per prompt (OpenAI accepts a batch of prompts)."""
    if req.max_tokens == 0 and not req.echo:
        raise GatewayError(400, "max_tokens 0 needs echo: it returns the prompt alone", param="max_tokens")
    if req.echo and req.truncate_prompt_tokens is not None:
        raise GatewayError(400, "truncate_prompt_tokens cannot be combined with echo: the echoed prompt would not "
                           "be the one scored", param="truncate_prompt_tokens")
    prompts = req.prompts()
    out = []
    for i, prompt in enumerate(prompts):
        message = pb.GenerateRequest(  # a prompt alone still takes one token: the engine's least
            model=req.model, request_id=request_id if len(prompts) == 1 else f"{request_id}-{i}", n=req.n,
            sampling=_sampling(req), stopping=_stopping(req, 1 if req.prompt_only else req.max_tokens),
            logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0, **constraint(req),
            **_scheduling(req),  # echo shows the prompt's logprobs, which carry its tokens' text
            **_prompt_logprobs(req, (req.logprobs or 0) if req.echo else None))
        if isinstance(prompt, str):
            message.text = prompt
        else:
            message.token_ids.ids.extend(prompt)
        out.append(message)
    return out


# ---- pieces of responses -------------------------------------------------------------

def _finite(logprob: float) -> float:
    # JSON has no -Infinity; OpenAI reports impossible tokens as -9999.
    return logprob if math.isfinite(logprob) else -9999.0


_USAGE_FIELDS = ("prompt_tokens", "completion_tokens", "cached_tokens", "draft_tokens", "accepted_draft_tokens",
                 "reasoning_tokens")


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int, draft_tokens: int = 0,
          accepted_draft_tokens: int = 0, reasoning_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object. Speculative decoding's drafted tokens are reported as OpenAI reports
    predicted outputs: accepted ones (completion tokens that took no step of their own) and
    rejected ones (computed, then dropped); a thinking model's thought as reasoning tokens."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted_draft_tokens,
                                          "rejected_prediction_tokens": draft_tokens - accepted_draft_tokens,
                                          "reasoning_tokens": reasoning_tokens}}


def _usage_of(messages: list[Any], fields: tuple[str, ...] = _USAGE_FIELDS) -> dict[str, Any]:
    """usage() summed over the `usage` of several responses or stream finals (`fields` alone)."""
    return usage(*(sum(getattr(m.usage, f) for m in messages) if f in fields else 0 for f in _USAGE_FIELDS))


# A prompt alone (echo, max_tokens 0) bills its prompt: the token the engine took is not returned.
_PROMPT_USAGE = ("prompt_tokens", "cached_tokens")


def finish_reason(message: Any) -> str:
    """OpenAI's finish_reason for a finished choice; GatewayError 500 for one that did not complete."""
    reason = FINISH_REASONS.get(message.finish_reason)
    if reason is None:
        value = message.finish_reason
        name = pb.FinishReason.Name(value) if value in pb.FinishReason.values() else str(value)
        raise GatewayError(500, f"completion {message.index} did not complete: the server ended it ({name})",
                           "server_error", code="generation_failed")
    return reason


def stop_reason(message: Any) -> int | str | None:
    which = message.WhichOneof("matched_stop")
    return getattr(message, which) if which else None


def _chat_token(entry: pb.TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": _finite(entry.logprob), "bytes": list(entry.bytes)}


def chat_logprobs(positions: Any) -> dict[str, Any]:
    content = [{**_chat_token(p.chosen), "top_logprobs": [_chat_token(t) for t in p.top]} for p in positions]
    return {"content": content, "refusal": None}


def completion_logprobs(positions: Any, offset: int, top_k: int | None = None) -> dict[str, Any]:
    """OpenAI's legacy logprobs; text_offset counts characters from `offset`; `top_k`: at most
    that many alternatives per position."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for p in positions:
        tokens.append(p.chosen.token)
        token_logprobs.append(_finite(p.chosen.logprob))
        alternatives = {t.token: _finite(t.logprob) for t in p.top[:top_k]}
        alternatives.setdefault(p.chosen.token, _finite(p.chosen.logprob))
        top.append(alternatives)
        offsets.append(offset)
        offset += len(p.chosen.token)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


@dataclass
class Echo:
    """A prompt as a completion echoes it: its text, the prompt's part of the legacy logprobs,
    and where the completion's text_offset goes on from."""

    text: str
    logprobs: dict[str, Any]
    offset: int

    @classmethod
    def of(cls, prompt: str | list[int], lp: pb.PromptLogprobs, top_k: int) -> Echo:
        """The prompt as sent when it was text; the text of its tokens when it was token ids.
        `top_k`: the request's logprobs (prompt_logprobs may have asked the service for more)."""
        rest = completion_logprobs(lp.positions, len(lp.first.token), top_k)
        logprobs = {"tokens": [lp.first.token, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
                    "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}
        offset = len(lp.first.token) + sum(len(p.chosen.token) for p in lp.positions)
        if isinstance(prompt, str):
            return cls(prompt, logprobs, offset)
        raw = b"".join([lp.first.bytes, *(p.chosen.bytes for p in lp.positions)])
        return cls(raw.decode("utf-8", errors="replace"), logprobs, offset)

    def joined(self, completion: dict[str, Any]) -> dict[str, Any]:
        """The whole logprobs of an echoed completion: the prompt's, then the completion's."""
        return {key: self.logprobs[key] + completion[key] for key in self.logprobs}


def vllm_prompt_logprobs(lp: pb.PromptLogprobs, top_k: int) -> list[dict[str, Any] | None]:
    """vLLM's prompt_logprobs: None for the first token, then per token {token id: {logprob, rank,
    decoded_token}} for it and its `top_k` most likely alternatives."""
    def entry(t: pb.TokenLogprob, rank: int) -> dict[str, Any]:
        return {"logprob": _finite(t.logprob), "rank": rank, "decoded_token": t.token}
    return [None, *({str(p.chosen.token_id): entry(p.chosen, p.chosen.rank),
                     **{str(t.token_id): entry(t, i + 1) for i, t in enumerate(p.top[:top_k])}}
                    for p in lp.positions)]


def no_prompt_logprobs() -> GatewayError:
    """The prompt's logprobs missing, which only a service that predates them leaves out."""
    return GatewayError(500, "the service sent no prompt logprobs (is it older than the gateway?)", "server_error")


def _prompt_logprobs_of(resp: pb.GenerateResponse) -> pb.PromptLogprobs:
    if not resp.HasField("prompt_logprobs"):
        raise no_prompt_logprobs()
    return resp.prompt_logprobs


# ---- whole (non-streaming) responses -------------------------------------------------

def chat_completion(resp: pb.GenerateResponse, response_id: str, created: int, model: str,
                    want_logprobs: bool, prompt_logprobs: int | None = None, echo: str = "") -> dict[str, Any]:
    """`prompt_logprobs`: vLLM's, once for the response (the prompt is the same for each choice);
    `echo`: text that begins each answer."""
    choices = [{
        "index": c.index,
        "message": _message(c, echo),
        "logprobs": chat_logprobs(c.logprobs) if want_logprobs else None,
        "finish_reason": finish_reason(c),
        "stop_reason": stop_reason(c),
    } for c in resp.choices]
    out = {"id": response_id, "object": "chat.completion", "created": created, "model": resp.model or model,
           "choices": choices, "system_fingerprint": None, "usage": _usage_of([resp])}
    if prompt_logprobs is not None:
        out["prompt_logprobs"] = vllm_prompt_logprobs(_prompt_logprobs_of(resp), prompt_logprobs)
    return out


def _message(choice: pb.Choice, echo: str = "") -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": echo + choice.text, "refusal": None}
    if choice.tool_calls:
        message["content"] = message["content"] or None
        message["tool_calls"] = tools.message_tool_calls(choice.tool_calls)
    return message | reasoning(choice.reasoning)


def reasoning(text: str) -> dict[str, str]:
    """A thought's fields in a message or delta: `reasoning` (vLLM's), and `reasoning_content`
    (DeepSeek's, which many clients read)."""
    return {"reasoning": text, "reasoning_content": text} if text else {}


def text_completion(resps: list[pb.GenerateResponse], response_id: str, created: int,
                    req: CompletionRequest) -> dict[str, Any]:
    """One choice per prompt and n, ordered so. With echo each begins with its prompt (and is
    nothing else with max_tokens 0); with prompt_logprobs each carries vLLM's list of them."""
    want_logprobs, top_k, echo = req.logprobs is not None, req.logprobs or 0, req.prompts() if req.echo else None
    choices = []
    for p, resp in enumerate(resps):
        echoed = Echo.of(echo[p], _prompt_logprobs_of(resp), top_k) if echo else None
        scored = None if req.prompt_logprobs is None else \
            vllm_prompt_logprobs(_prompt_logprobs_of(resp), req.prompt_logprobs)
        for c in resp.choices:
            choice = (_prompt_choice(p * req.n + c.index, echoed, want_logprobs) if req.prompt_only else
                      _text_choice(p * req.n + c.index, c, echoed, want_logprobs, top_k))
            choices.append(choice if scored is None else {**choice, "prompt_logprobs": scored})
    return {"id": response_id, "object": "text_completion", "created": created,
            "model": (resps[0].model if resps else "") or req.model, "choices": choices,
            "system_fingerprint": None,
            "usage": _usage_of(resps, _PROMPT_USAGE if req.prompt_only else _USAGE_FIELDS)}


def _text_choice(index: int, c: pb.Choice, echoed: Echo | None, want_logprobs: bool, top_k: int
                 ) -> dict[str, Any]:
    logprobs = None
    if want_logprobs:
        logprobs = completion_logprobs(c.logprobs, echoed.offset if echoed else 0, top_k)
        logprobs = echoed.joined(logprobs) if echoed else logprobs
    return {"index": index, "text": (echoed.text if echoed else "") + c.text, "logprobs": logprobs,
            "finish_reason": finish_reason(c), "stop_reason": stop_reason(c)}


def _prompt_choice(index: int, echoed: Echo, want_logprobs: bool) -> dict[str, Any]:
    """A choice that is its prompt alone: it ended at its length, 0 tokens."""
    return {"index": index, "text": echoed.text, "logprobs": echoed.logprobs if want_logprobs else None,
            "finish_reason": "length", "stop_reason": None}
