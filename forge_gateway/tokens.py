"""POST /tokenize and /detokenize (vLLM's routes and shapes): a prompt's token count before sending
it, and token ids back to text. A chat prompt is counted as /v1/chat/completions would feed it
(template, tools, the assistant generation prompt or the last message left open), through the
service's Tokenize RPC."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator

from forge_gateway import convert
from forge_gateway.errors import GatewayError
from forge_gateway.models import _CONFIG, ChatCompletionRequest, ChatMessage, CompletionRequest, TokenId
from forge_gateway.tools import ToolDef
from forge_service.pb import forge_pb2 as pb


class TokenizeRequest(BaseModel):
    model_config = _CONFIG

    model: str
    prompt: str | list[TokenId] | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    # The chat route's template controls (see ChatCompletionRequest).
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Only what the generation routes do is offered: they always add them.
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("set exactly one of prompt and messages")
        if self.messages is None and (self.tools is not None or self.add_generation_prompt is not None
                                      or self.continue_final_message or self.chat_template_kwargs is not None):
            raise ValueError("tools, add_generation_prompt, continue_final_message and chat_template_kwargs need "
                             "messages")
        if not self.add_special_tokens:
            raise ValueError("add_special_tokens can only be true: prompts are counted as the generation routes "
                             "feed them")
        return self


class DetokenizeRequest(BaseModel):
    model_config = _CONFIG

    model: str
    tokens: list[TokenId]


def tokenize_request(req: TokenizeRequest, request_id: str) -> pb.GenerateRequest:
    """The GenerateRequest whose prompt is the one to count."""
    if req.messages is not None:
        chat = ChatCompletionRequest(model=req.model, messages=req.messages, tools=req.tools,
                                     add_generation_prompt=req.add_generation_prompt,
                                     continue_final_message=req.continue_final_message,
                                     chat_template_kwargs=req.chat_template_kwargs)
        return convert.chat_request(chat, request_id)
    return convert.completion_requests(CompletionRequest(model=req.model, prompt=req.prompt), request_id)[0]


def tokenize_response(resp: pb.TokenizeResponse) -> dict[str, Any]:
    return {"count": resp.count, "max_model_len": resp.max_model_len, "tokens": list(resp.token_ids)}


def detokenize_request(req: DetokenizeRequest) -> pb.DetokenizeRequest:
    return pb.DetokenizeRequest(model=req.model, token_ids=req.tokens)


def detokenize_error(error: GatewayError) -> GatewayError:
    """A Detokenize error, its param named as in the request: the service's token_ids (which the
    generation routes call `prompt`) are `tokens` here."""
    if error.param == "prompt":
        error.param = "tokens"
    return error
