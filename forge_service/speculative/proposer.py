"""Per-request drafting state for the scheduler: an n-gram index and an adaptive draft length."""
from __future__ import annotations

from dataclasses import dataclass

from forge_service.config import SpeculativeConfig
from forge_service.engine.request import Request
from forge_service.speculative.ngram import AdaptiveDraftLength, NgramIndex
from forge_service.speculative.prediction import PredictionDraft


@dataclass
class _State:
    index: NgramIndex
    length: AdaptiveDraftLength
    prediction: PredictionDraft | None = None


class NgramProposer:
    """Drafts for running requests from their predicted output, where they have one, else from
    their own prompt and output. The scheduler asks for a draft when it schedules a request's
    decode and reports back how much of it was accepted."""

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
            state = self._states[request.request_id] = self._new_state(request, max_k)
        index = state.index
        if len(index) < request.num_tokens:  # the tokens appended since the last draft
            index.extend(request.token_ids_slice(len(index), request.num_tokens))
        k = min(limit, state.length.draft_len(worth))
        if k <= 0:
            return []
        if state.prediction is not None:
            draft = state.prediction.propose(request.output_token_ids, index.tokens, k)
            if draft:
                return draft
        return index.propose(k)

    def _new_state(self, request: Request, max_k: int) -> _State:
        low, high = self.config.spec_ngram_min, self.config.spec_ngram_max
        prediction = request.sampling_params.prediction
        return _State(NgramIndex(low, high), AdaptiveDraftLength(max_k),
                      PredictionDraft(prediction, low, high) if prediction else None)

    def update(self, request_id: str, proposed: int, accepted: int) -> None:
        state = self._states.get(request_id)
        if state is not None:
            state.length.update(proposed, accepted)
            if state.prediction is not None:
                state.prediction.accepted(accepted)

    def release(self, request_id: str) -> None:
        self._states.pop(request_id, None)
