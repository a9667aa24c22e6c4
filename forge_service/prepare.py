"""A generation request's engine inputs: the model or adapter it names, its sampling parameters and
its prompt tokens (tokenized in the tokenizer pool), checked against the limits, the model and the
engine before it is queued."""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from forge_service import convert, limits
from forge_service.admission import TokenizerPool, check_prompt_chars
from forge_service.config import ServiceConfig
from forge_service.engine.async_engine import AsyncEngine
from forge_service.errors import ModelNotFound, blame, excerpt
from forge_service.pb import forge_pb2 as pb


@dataclass(frozen=True)
class LoadedModel:
    """What the servicer needs once the engine is up."""

    engine: AsyncEngine
    tokenizer: Any
    name: str
    max_model_len: int
    created: int
    longest_token_chars: int | None = None  # for the length check before tokenizing
    hidden_size: int | None = None  # an embedding's length
    adapters: tuple[str, ...] = ()  # LoRA adapters served beside it, by name (--lora-modules)
    # The model's values for sampling fields a request leaves unset (--generation-config auto).
    sampling_defaults: dict[str, float | int] = field(default_factory=dict)

    def served_name(self, params) -> str:
        """The name a request's responses, log line and trace carry: its adapter's, or the model's."""
        return params.adapter or self.name


@dataclass(frozen=True)
class Prepared:
    """A request checked, tokenized and compiled: what the servicer hands the engine."""

    request_id: str  # the client's id (or a made-up one): echoed, logged, never an engine key
    prompt: list[int]
    params: Any
    output: convert.OutputProcessor  # tool-call parsing, the after-the-fact schema check
    first_prompt_token: pb.TokenLogprob | None = None  # with prompt_logprobs: the one they leave out
    # The engine's key: fresh per request, so a client's id can never reach another's request.
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)


def check_model(name: str, model: LoadedModel) -> str | None:
    """The LoRA adapter a request's model names (None: the base model); ModelNotFound for a name
    not served here."""
    if not name or name == model.name:
        return None
    if name in model.adapters:
        return name
    served = ", ".join(map(repr, (model.name, *model.adapters)))
    raise ModelNotFound(f"model {excerpt(name)} is not served here; this server serves {served}", field="model")


async def tokenize_request(request: pb.GenerateRequest, model: LoadedModel, config: ServiceConfig,
                    pool: TokenizerPool) -> list[int]:
    """A request's prompt tokens as prepare_request makes them, without the context's bound."""
    check_model(request.model, model)
    limits.check_request(request, config.limits)
    tools = convert.tools(request, model.tokenizer)
    with blame(request.WhichOneof("input")):
        return await pool.run(convert.input_token_ids, request, model.tokenizer, tools)


async def prepare_request(request: pb.GenerateRequest, model: LoadedModel, config: ServiceConfig,
                   pool: TokenizerPool) -> Prepared:
    adapter = check_model(request.model, model)
    # An error names the request field at fault (trailing metadata, see errors.py); where its
    # raiser does not, it is the stage's: the input (text | chat | token_ids), the constraint.
    source = request.WhichOneof("input")
    limits.check_request(request, config.limits)
    with blame(source):
        if not request.HasField("truncate_prompt_tokens"):  # a prompt to be cut may be longer than the context
            check_prompt_chars(_prompt_chars(request), model.longest_token_chars, model.max_model_len)
    tools = convert.tools(request, model.tokenizer)
    with convert.request_fields():
        params = convert.sampling_params(request, tools, model.sampling_defaults)
        params.adapter = adapter
        params.validate(model.tokenizer.vocab_size)
    with blame(source):
        prompt = await pool.run(convert.prompt_token_ids, request, model.tokenizer, model.max_model_len, tools)
    if request.prediction:
        with blame("prediction"):
            params.prediction = await pool.run(convert.prediction_token_ids, request, model.tokenizer,
                                               model.max_model_len)
    limits.check_total_tokens(params.n, params.max_tokens or model.max_model_len - len(prompt), config.limits)
    with convert.request_fields(), blame(source):
        model.engine.validate(prompt, params)  # prompt + max_tokens against the context and the KV cache
    with blame(request.WhichOneof("constraint") or ("tools" if tools is not None else None)):
        await model.engine.compile_constraint(params)  # structured output: compiled before it is queued
    request_id = request.request_id or uuid.uuid4().hex
    first = None if params.prompt_logprobs is None else convert.first_prompt_token(model.tokenizer, prompt[0])
    processor = convert.output_processor(request, request_id, tools, model.tokenizer, prompt, config.reasoning_parser)
    return Prepared(request_id, prompt, params, processor, first)


def _prompt_chars(request: pb.GenerateRequest) -> int:
    """Characters the prompt has at least: a template may strip a message's surrounding whitespace."""
    kind = request.WhichOneof("input")
    if kind == "text":
        return len(request.text)
    if kind == "chat":
        return sum(len(m.content.strip()) for m in request.chat.messages)
    return 0
