"""Per-request drafting state for the scheduler: an n-gram index and an adaptive draft length."""
from __future__ import annotations

from dataclasses import dataclass

from forge_service.config import SpeculativeConfig
from forge_service.engine.request import Request
from forge_service.speculative.ngram import AdaptiveDraftLength, NgramIndex


@dataclass
class _State:
    index: NgramIndex
    length: AdaptiveDraftLength


class NgramProposer:
    """Drafts for running requests from their own prompt and output. The scheduler asks for a
    draft when it schedules a request's decode and reports back how much of it was accepted."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._states: dict[str, _State] = {}

    def propose(self, request: Request, limit: int, worth: float = 0.0) -> list[int]:
        """Up to `limit` tokens to verify after the request's last token; [] for none. `worth`: the
        probability of being kept that a verified position needs to pay for its row."""
        if limit <= 0 or request.sampling_params.num_speculative_tokens == 0:
            return []
        state = self._states.get(request.request_id)
        if state is None:
            wanted = request.sampling_params.num_speculative_tokens
            max_k = self.config.spec_max_draft if wanted is None else min(wanted, self.config.spec_max_draft)
            state = self._states[request.request_id] = _State(
                NgramIndex(self.config.spec_ngram_min, self.config.spec_ngram_max), AdaptiveDraftLength(max_k))
        index = state.index
        if len(index) < request.num_tokens:  # the tokens appended since the last draft
            index.extend(request.token_ids_slice(len(index), request.num_tokens))
        k = min(limit, state.length.draft_len(worth))
        return index.propose(k) if k > 0 else []

    def update(self, request_id: str, proposed: int, accepted: int) -> None:
        state = self._states.get(request_id)
        if state is not None:
            state.length.update(proposed, accepted)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
