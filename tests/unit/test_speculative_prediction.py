"""Drafting from a predicted output: following its start, finding the way back after an edit, and
the proposer preferring it to the n-gram index."""
from __future__ import annotations

from forge_service.config import SpeculativeConfig
from forge_service.engine.request import Request, SamplingParams
from forge_service.speculative.prediction import PredictionDraft
from forge_service.speculative.proposer import NgramProposer

PROMPT = [90, 91, 92]
PREDICTION = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 9]


def test_an_output_that_follows_the_prediction_is_drafted_its_next_tokens() -> None:
    draft = PredictionDraft(PREDICTION)
    assert draft.propose([], PROMPT, 3) == [1, 2, 3]  # nothing generated yet: the prediction's start
    assert draft.propose([1, 2], PROMPT + [1, 2], 4) == [3, 4, 5, 6]
    assert draft.propose([1, 2], PROMPT + [1, 2], 0) == []
    assert draft.propose(PREDICTION, PROMPT + PREDICTION, 4) == []  # the whole prediction is out


def test_after_an_edit_the_draft_resumes_where_the_output_rejoins_the_prediction() -> None:
    draft = PredictionDraft(PREDICTION)
    output = [1, 2, 3, 4, 50, 51]  # 5, 6 edited into 50, 51: no n-gram of the prediction ends the output
    assert draft.propose(output, PROMPT + output, 3) == []
    output += [7, 8]  # back in the prediction, two tokens later
    assert draft.propose(output, PROMPT + output, 3) == [1, 2, 3]


def test_a_repeated_ngram_is_taken_at_or_after_the_last_accepted_run() -> None:
    output = [1, 2, 3, 40]  # left the prediction at once; (1, 2) occurs at 0 and at 8
    draft = PredictionDraft(PREDICTION)
    assert draft.propose(output, PROMPT + output, 2) == []
    output += [1, 2]
    assert draft.propose(output, PROMPT + output, 2) == [3, 4]  # cursor 0: the first occurrence
    draft.accepted(2)  # [3, 4] accepted: the run ended at 4
    output += [3, 4, 70, 1, 2]
    assert draft.propose(output, PROMPT + output, 2) == [3, 9]  # the occurrence after 4
    draft.accepted(0)  # cursor 10: no (1, 2) at or after it, so the last one before
    assert draft.propose(output, PROMPT + output, 2) == [3, 9]


def request(request_id: str, prediction: list[int] | None, output: list[int], spec: int | None = None) -> Request:
    params = SamplingParams(max_tokens=64, prediction=prediction, num_speculative_tokens=spec)
    return Request(request_id, PROMPT + [5, 6, 7, 8, 11, 12], params, output_token_ids=list(output))


def test_the_proposer_drafts_from_the_prediction_first_then_from_the_context() -> None:
    proposer = NgramProposer(SpeculativeConfig(spec_max_draft=4))
    # The prompt holds 5 6 7 8 11 12, so the n-gram index alone continues (7, 8) with 11 12 1 2.
    assert proposer.propose(request("a", PREDICTION, [1, 2, 3, 4, 5, 6, 7, 8]), 4) == [1, 2, 3, 9]
    assert proposer.propose(request("b", None, [1, 2, 3, 4, 5, 6, 7, 8]), 4) == [11, 12, 1, 2]
    # Past the prediction's end, with an ending it does not hold: the context's n-gram.
    assert proposer.propose(request("c", PREDICTION, PREDICTION + [8, 11]), 4) == [12, 1, 2, 3]
    assert proposer.propose(request("d", PREDICTION, [1, 2], spec=0), 4) == []  # drafting off: none at all
