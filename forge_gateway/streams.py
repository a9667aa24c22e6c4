"""forge.v1 stream messages -> OpenAI's chat.completion.chunk and text_completion chunks, for the
gateway's SSE loop (the Responses API has its own formatter in responses.py)."""
from __future__ import annotations

from typing import Any, Protocol

from forge_gateway import convert, tools
from forge_service.pb import forge_pb2 as pb


class StreamFormatter(Protocol):
    """What the gateway's SSE loop needs of a stream's formatter: the events to send first, for each
    stream message (with its prompt's index), and last."""

    named_events: bool  # SSE events named by their payload's type (the Responses API's)
    done_marker: bool  # the stream ends with `data: [DONE]`

    def start(self, first: pb.StreamResponse) -> list[dict[str, Any]]:
        """The opening events, given the stream's first message (passed to on_message next)."""

    def on_message(self, prompt: int, message: pb.StreamResponse) -> list[dict[str, Any]]: ...

    def end(self) -> list[dict[str, Any]]: ...


class _Stream:
    """Turns stream messages from one or more prompts into OpenAI chunk objects."""

    object_name = ""
    named_events = False
    done_marker = True

    def __init__(self, response_id: str, created: int, model: str, n: int, want_logprobs: bool,
                 include_usage: bool, continuous_usage: bool = False) -> None:
        """`continuous_usage` (with include_usage): every chunk with choices carries the usage so far."""
        self.response_id, self.created, self.model, self.n = response_id, created, model, n
        self.want_logprobs, self.include_usage = want_logprobs, include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens = 0
        self.generated = 0  # tokens in the chunks so far, every choice's
        self.draft_tokens = self.accepted_draft_tokens = self.reasoning_tokens = 0

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out = {"id": self.response_id, "object": self.object_name, "created": self.created, "model": self.model,
               "system_fingerprint": None, "choices": choices}
        if self.include_usage:
            out["usage"] = self._usage_so_far() if self.continuous_usage and choices else None
        return out

    def _usage_so_far(self) -> dict[str, int]:
        """The prompts' tokens and those generated up to here (the last chunk's equals the final usage's)."""
        prompt = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.generated, "total_tokens": prompt + self.generated}

    def _note_prompt(self, prompt: int, message: pb.StreamResponse) -> None:
        """The prompt's token count, from whichever message tells it first."""
        kind = message.WhichOneof("event")
        if kind == "chunk" and message.chunk.prompt_tokens:
            self.prompt_tokens[prompt] = message.chunk.prompt_tokens
        elif kind == "prompt_logprobs":  # one entry per prompt token after the first
            self.prompt_tokens[prompt] = len(message.prompt_logprobs.positions) + 1

    def start(self, first: pb.StreamResponse) -> list[dict[str, Any]]:
        return []

    def on_message(self, prompt: int, message: pb.StreamResponse) -> list[dict[str, Any]]:
        kind = message.WhichOneof("event")
        self._note_prompt(prompt, message)
        if kind == "chunk":
            self.generated += len(message.chunk.token_ids)
            choice = self._delta(prompt * self.n + message.chunk.index, message.chunk)
            return [self.chunk([choice])] if choice else []
        if kind == "prompt_logprobs":
            return self._prompt(prompt, message.prompt_logprobs)
        if kind != "final":
            return []  # an event this gateway does not know
        final = message.final
        self.prompt_tokens[prompt] = final.usage.prompt_tokens
        self.cached_tokens[prompt] = final.usage.cached_tokens
        self.completion_tokens += final.usage.completion_tokens
        self.draft_tokens += final.usage.draft_tokens
        self.accepted_draft_tokens += final.usage.accepted_draft_tokens
        self.reasoning_tokens += final.usage.reasoning_tokens
        return [self.chunk([self._final(prompt * self.n + final.index, final)])]

    def end(self) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        total = convert.usage(sum(self.prompt_tokens.values()), self.completion_tokens,
                              sum(self.cached_tokens.values()), self.draft_tokens, self.accepted_draft_tokens,
                              self.reasoning_tokens)
        return [{**self.chunk([]), "usage": total}]

    def _prompt(self, prompt: int, logprobs: pb.PromptLogprobs) -> list[dict[str, Any]]:
        return []  # asked for by completions' echo alone

    def _delta(self, index: int, chunk: pb.StreamChunk) -> dict[str, Any] | None:
        raise NotImplementedError

    def _final(self, index: int, final: pb.StreamFinal) -> dict[str, Any]:
        raise NotImplementedError


class ChatStream(_Stream):
    """`echo`: text that begins each answer, sent with its role."""

    object_name = "chat.completion.chunk"

    def __init__(self, *args: Any, echo: str = "") -> None:
        super().__init__(*args)
        self.echo = echo

    def start(self, first: pb.StreamResponse) -> list[dict[str, Any]]:
        self._note_prompt(0, first)
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": self.echo}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.n)]

    def _delta(self, index: int, chunk: pb.StreamChunk) -> dict[str, Any] | None:
        if not (chunk.text or chunk.tool_calls or chunk.reasoning or (self.want_logprobs and chunk.logprobs)):
            return None  # tokens held back (a possible stop string, tool-call markup): nothing to show yet
        shows_content = chunk.text or not (chunk.tool_calls or chunk.reasoning)
        delta: dict[str, Any] = {"content": chunk.text} if shows_content else {}
        delta |= convert.reasoning(chunk.reasoning)
        if chunk.tool_calls:
            delta["tool_calls"] = tools.delta_tool_calls(chunk.tool_calls)
        logprobs = convert.chat_logprobs(chunk.logprobs) if self.want_logprobs else None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}

    def _final(self, index: int, final: pb.StreamFinal) -> dict[str, Any]:
        return {"index": index, "delta": {}, "logprobs": None, "finish_reason": convert.finish_reason(final),
                "stop_reason": convert.stop_reason(final)}


class CompletionStream(_Stream):
    object_name = "text_completion"

    def __init__(self, *args: Any, echo: list[str | list[int]] | None = None, prompt_only: bool = False,
                 top_k: int = 0, **kwargs: Any) -> None:
        """`echo`: the prompts, when each completion starts with its own; `prompt_only`: and is
        nothing else (echo with max_tokens 0); `top_k`: the request's logprobs."""
        super().__init__(*args, **kwargs)
        self.offsets: dict[int, int] = {}
        self.echo, self.prompt_only, self.top_k = echo, prompt_only, top_k
        self.echoed: set[int] = set()  # the choices that began with their prompt

    def end(self) -> list[dict[str, Any]]:
        if self.prompt_only:  # the token each prompt took is not returned, so not billed
            self.completion_tokens = self.draft_tokens = self.accepted_draft_tokens = 0
        return super().end()

    def _usage_so_far(self) -> dict[str, int]:
        usage = super()._usage_so_far()
        if self.prompt_only:  # billed as end() bills it
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return usage

    def _prompt(self, prompt: int, logprobs: pb.PromptLogprobs) -> list[dict[str, Any]]:
        """Each of the prompt's completions begins with the echoed prompt (its logprobs too)."""
        if not self.echo:
            return []
        echoed = convert.Echo.of(self.echo[prompt], logprobs, self.top_k)
        chunks = []
        for index in range(prompt * self.n, (prompt + 1) * self.n):
            self.offsets[index] = echoed.offset
            self.echoed.add(index)
            chunks.append(self.chunk([{"index": index, "text": echoed.text, "finish_reason": None,
                                       "logprobs": echoed.logprobs if self.want_logprobs else None}]))
        return chunks

    def _delta(self, index: int, chunk: pb.StreamChunk) -> dict[str, Any] | None:
        if self.prompt_only or (not chunk.text and not (self.want_logprobs and chunk.logprobs)):
            return None
        logprobs = None
        if self.want_logprobs:
            logprobs = convert.completion_logprobs(chunk.logprobs, self.offsets.get(index, 0))
            self.offsets[index] = self.offsets.get(index, 0) + sum(len(p.chosen.token) for p in chunk.logprobs)
        return {"index": index, "text": chunk.text, "logprobs": logprobs, "finish_reason": None}

    def _final(self, index: int, final: pb.StreamFinal) -> dict[str, Any]:
        if self.echo and index not in self.echoed:
            raise convert.no_prompt_logprobs()
        if self.prompt_only:
            return {"index": index, "text": "", "logprobs": None, "finish_reason": "length", "stop_reason": None}
        return {"index": index, "text": "", "logprobs": None, "finish_reason": convert.finish_reason(final),
                "stop_reason": convert.stop_reason(final)}
