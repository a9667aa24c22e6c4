"""The contract between the scheduler (plain Python) and the model runner (tensors)."""
from __future__ import annotations

from dataclasses import dataclass, field

from forge_service.engine.request import Request


@dataclass
class ScheduledChunk:
    """Tokens [start, start + num_tokens) of one request are computed this step."""

    request: Request
    start: int
    num_tokens: int
    block_ids: list[int]
    # Speculative tokens to verify after the request's last token: they are the chunk's last
    # len(draft) tokens (counted in num_tokens) and each gets a logits row.
    draft: list[int] = field(default_factory=list)
    # (cached block, this request's block, tokens): a prefix-cache hit that ends inside a block.
    # Before this step, the runner copies those tokens' keys and values into the request's block.
    kv_copy: tuple[int, int, int] | None = None
    # True when this chunk reaches the last known token, so a new token is sampled. Fixed at
    # scheduling time: after update() appends the sampled token the request has grown past it.
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.end - len(self.draft) == self.request.num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    # Requests preempted this step: their blocks were freed and they wait for recompute.
    preempted: list[Request] = field(default_factory=list)
    # The last `num_admitted` chunks belong to requests admitted from the waiting queue this step.
    num_admitted: int = 0
    # Requests whose admission raised: already out of the scheduler, with the error.
    failed: list[tuple[Request, Exception]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks
