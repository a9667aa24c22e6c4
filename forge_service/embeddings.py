"""Embeddings: a prompt's final hidden state at its last token (last-token pooling), through the
engine as a one-token request (SamplingParams.embed), then cut and normalised.

Decoder embedding models (Qwen3-Embedding, e5-mistral, gte-Qwen2) are trained to put the text's
meaning in the last token's state; a chat model's is usable but not trained for it.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from forge_service.convert import check_vocabulary
from forge_service.engine.request import SamplingParams
from forge_service.errors import InvalidArgument

MAX_INPUTS = 2048  # per request, as OpenAI's API takes


def embed_params(adapter: str | None = None) -> SamplingParams:
    """An embedding request's engine parameters: its prompt computed (through `adapter`, a LoRA
    adapter's name, where given), one greedy token (thrown away), never drafted."""
    return SamplingParams(embed=True, max_tokens=1, temperature=0.0, ignore_eos=True, num_speculative_tokens=0,
                          adapter=adapter)


def pooled(hidden: Sequence[float], dimensions: int | None = None, normalize: bool = True) -> list[float]:
    """The first `dimensions` values of a hidden state, scaled to unit length with `normalize`
    (a zero vector stays zero)."""
    values = list(hidden[:dimensions] if dimensions else hidden)
    if normalize:
        norm = math.sqrt(math.fsum(v * v for v in values))
        if norm > 0:
            values = [v / norm for v in values]
    return values


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    if dimensions is not None and not 1 <= dimensions <= hidden_size:
        raise InvalidArgument(f"dimensions must be in [1, {hidden_size}] (the model's hidden size), got {dimensions}",
                              field="dimensions")


def input_token_ids(index: int, item: Any, tokenizer: Any, max_model_len: int) -> list[int]:
    """An EmbedInput's token ids; InvalidArgument naming inputs[index] when it is empty, outside
    the vocabulary or too long for the context (with the one token an embedding takes)."""
    field = f"inputs[{index}]"
    kind = item.WhichOneof("input")
    if kind == "text":
        ids = list(tokenizer.encode(item.text)) if item.text else []
    elif kind == "token_ids":
        ids = list(item.token_ids.ids)
        check_vocabulary(ids, tokenizer.vocab_size, f"{field} has token id", field=field)
    else:
        raise InvalidArgument(f"{field} is empty: set text or token_ids", field=field)
    if not ids:
        raise InvalidArgument(f"{field} is empty", field=field)
    if len(ids) + 1 > max_model_len:
        raise InvalidArgument(f"{field} has {len(ids)} tokens; the context length is {max_model_len} "
                              f"(an embedding takes one more)", field=field)
    return ids
