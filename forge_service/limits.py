"""Per-request bounds (LimitsConfig), checked on the proto before any tokenizing or compiling."""
from __future__ import annotations

from forge_service.config import LimitsConfig
from forge_service.errors import LIMIT_EXCEEDED, InvalidArgument, excerpt
from forge_service.pb import forge_pb2 as pb


def check_request(request: pb.GenerateRequest, limits: LimitsConfig) -> None:
    """Raise InvalidArgument naming the first bound the request breaks, its flag and by how much."""
    kind = request.WhichOneof("input")
    if kind == "text":
        _check_chars("the text prompt", request.text, limits.max_message_chars, "text")
    elif kind == "chat":
        messages = request.chat.messages
        if len(messages) > limits.max_messages:
            raise InvalidArgument(f"chat.messages has {len(messages)} messages; at most {limits.max_messages} "
                                  f"are accepted (--max-messages)", field="chat.messages", kind=LIMIT_EXCEEDED)
        for i, message in enumerate(messages):
            what = f"chat.messages[{i}].content"
            _check_chars(what, message.content, limits.max_message_chars, what)
    if request.prediction:
        _check_chars("prediction", request.prediction, limits.max_message_chars, "prediction")
    for i, stop in enumerate(request.stopping.stop):
        if len(stop) > limits.max_stop_chars:
            raise InvalidArgument(f"stopping.stop[{i}] {excerpt(stop, 40)} is longer than {limits.max_stop_chars} "
                                  f"characters (--max-stop-chars)", field=f"stopping.stop[{i}]", kind=LIMIT_EXCEEDED)
    bias = len(request.sampling.logit_bias)
    if bias > limits.max_logit_bias:
        raise InvalidArgument(f"logit_bias has {bias} entries; at most {limits.max_logit_bias} are accepted "
                              f"(--max-logit-bias)", field="sampling.logit_bias", kind=LIMIT_EXCEEDED)
    if request.stopping.HasField("max_tokens"):
        check_total_tokens(request.n or 1, request.stopping.max_tokens, limits)


def check_total_tokens(n: int, max_tokens: int, limits: LimitsConfig) -> None:
    """n x max_tokens against --max-total-tokens (max_tokens: the effective one) when n > 1; one
    completion is bounded by the context alone."""
    if n > 1 and n * max_tokens > limits.max_total_tokens:
        raise InvalidArgument(f"n x max_tokens = {n} x {max_tokens} = {n * max_tokens} exceeds "
                              f"{limits.max_total_tokens} (--max-total-tokens): lower n or set a smaller max_tokens",
                              field="n", kind=LIMIT_EXCEEDED)


def _check_chars(what: str, text: str, limit: int, field: str) -> None:
    if len(text) > limit:
        raise InvalidArgument(f"{what} has {len(text)} characters; at most {limit} are accepted "
                              f"(--max-message-chars)", field=field, kind=LIMIT_EXCEEDED)
