"""bench/speculative_bound.py's replay: step costs between measured row counts, and the draft runs
an oracle and the adaptive length get from the n-gram index."""
from __future__ import annotations

import pytest

from bench.speculative_bound import replay, step_cost
from forge_service.config import SpeculativeConfig

COST = step_cost({1: 1.0, 3: 2.0, 9: 5.0})
CONFIG = SpeculativeConfig(spec_max_draft=4)
BASE = 2.2  # the step's fixed cost the adaptive length drafts with, in rows


def test_step_cost_is_linear_between_measured_rows_and_flat_past_the_last() -> None:
    assert [COST(r) for r in (1, 2, 3, 6, 9, 12)] == [1.0, 1.5, 2.0, 3.5, 5.0, 5.0]


def test_an_answer_that_copies_the_prompt_is_verified_in_runs_of_one_plus_the_longest_draft() -> None:
    text = list(range(100, 140))
    prompt, answer = [1, 2, *text], text
    seconds, steps = replay(prompt, answer, CONFIG, True, COST, BASE)
    # The first token comes with the prefill. The next step has no two-token suffix seen before
    # (139, 100), so it runs alone; then 38 tokens in runs of a full draft of 4 plus one, the last
    # run a draft of 2 plus one where the answer ends.
    assert steps == 1 + 8
    assert seconds == pytest.approx(COST(1) + 7 * COST(5) + COST(3))
    adaptive_seconds, adaptive_steps = replay(prompt, answer, CONFIG, False, COST, BASE)
    assert steps < adaptive_steps < len(answer) - 1  # the adaptive length drafts too, starting short
    assert adaptive_seconds > seconds


def test_nothing_to_copy_costs_the_oracle_nothing_and_the_adaptive_length_nothing() -> None:
    prompt, answer = [1, 2, 3], list(range(200, 260))
    seconds, steps = replay(prompt, answer, CONFIG, True, COST, BASE)
    assert (seconds, steps) == (pytest.approx((len(answer) - 1) * COST(1)), len(answer) - 1)
    assert replay(prompt, answer, CONFIG, False, COST, BASE) == (pytest.approx(seconds), steps)  # no match, no draft


def test_the_oracle_verifies_only_the_tokens_that_will_be_accepted() -> None:
    prompt = [1, *range(100, 120)]
    answer = [*range(100, 110), 7, 8, 9, *range(113, 120)]
    seconds, steps = replay(prompt, answer, CONFIG, True, COST, BASE)
    # 100 with the prefill; 101 alone; 102-105 drafted + 106; 107-109 drafted (110 would be
    # rejected, so not verified) + 7; 8, 9, 113 and 114 alone (no suffix seen before); 115-118
    # drafted + 119.
    assert steps == 8
    assert seconds == pytest.approx(COST(1) + COST(5) + COST(4) + 4 * COST(1) + COST(5))
