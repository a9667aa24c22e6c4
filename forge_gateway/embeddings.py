"""OpenAI's embeddings API (POST /v1/embeddings) on the service's Embed call."""
from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from forge_gateway.models import _CONFIG, _INT32
from forge_service.pb import forge_pb2 as pb

MAX_INPUTS = 2048  # OpenAI's bound, and the service's


class EmbeddingRequest(BaseModel):
    model_config = _CONFIG

    model: str
    # A text, texts, a token-id list or token-id lists; none of them empty.
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, le=_INT32)
    user: str | None = None
    # vLLM's: false leaves each embedding at its length (unit length by default).
    normalize: bool | None = None
    # vLLM's fields Forge does not take for embeddings: refused by name, not ignored.
    truncate_prompt_tokens: Any = None
    add_special_tokens: Any = None

    @field_validator("input")
    @classmethod
    def _inputs(cls, value: Any) -> str | list:
        items = [value] if isinstance(value, str) or (isinstance(value, list) and value and _ids(value[0])) \
            else value
        if not isinstance(items, list) or not all(isinstance(i, str) or _is_id_list(i) for i in items) \
                or len({isinstance(i, str) for i in items}) > 1:
            raise ValueError("input is a string, a list of strings, a list of token ids or a list of token-id lists")
        if not 1 <= len(items) <= MAX_INPUTS:
            raise ValueError(f"input must hold 1 to {MAX_INPUTS} items, got {len(items)}")
        if any(len(item) == 0 for item in items):
            raise ValueError("input must not hold an empty string or token list")
        return value

    @field_validator("truncate_prompt_tokens", "add_special_tokens")
    @classmethod
    def _refused(cls, value: Any, info: Any) -> Any:
        if value is not None:
            raise ValueError(f"{info.field_name} is not supported for embeddings")
        return value

    def items(self) -> list[pb.EmbedInput]:
        value = self.input
        if isinstance(value, str):
            return [pb.EmbedInput(text=value)]
        if _ids(value[0]):
            return [pb.EmbedInput(token_ids=pb.TokenIds(ids=value))]
        return [pb.EmbedInput(text=v) if isinstance(v, str) else pb.EmbedInput(token_ids=pb.TokenIds(ids=v))
                for v in value]


def _ids(value: Any) -> bool:
    """A token id: an int (not a bool) in range."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _INT32


def _is_id_list(value: Any) -> bool:
    return isinstance(value, list) and all(_ids(v) for v in value)


def embed_request(body: EmbeddingRequest, request_id: str) -> pb.EmbedRequest:
    message = pb.EmbedRequest(model=body.model, request_id=request_id, inputs=body.items())
    if body.dimensions is not None:
        message.dimensions = body.dimensions
    if body.normalize is not None:
        message.normalize = body.normalize
    return message


def response(resp: pb.EmbedResponse, body: EmbeddingRequest) -> dict[str, Any]:
    data = [{"object": "embedding", "index": i, "embedding": _encoded(list(e.values), body.encoding_format)}
            for i, e in enumerate(resp.embeddings)]
    tokens = resp.usage.prompt_tokens
    return {"object": "list", "data": data, "model": resp.model or body.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(values: list[float], encoding: str) -> list[float] | str:
    """float: the list; base64: little-endian float32 bytes, as OpenAI encodes them."""
    if encoding == "float":
        return values
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
