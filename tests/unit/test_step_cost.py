"""The decode step's cost by its rows, measured on the engine's own steps (speculative/step_cost.py):
the fixed part drafting weighs against the row each drafted token adds."""
from __future__ import annotations

import math

import pytest

from forge_service.speculative.step_cost import (MAX_BASE_ROWS, MIN_BASE_ROWS, MIN_STEPS, PRIOR_BASE_ROWS,
                                                 REFIT_EVERY, StepCost, base_from_line)


def timed(cost: StepCost, seconds_at, rows: list[int], steps: int) -> None:
    """`steps` steps at each of `rows` in turn, each taking seconds_at(rows)."""
    for _ in range(steps):
        for m in rows:
            cost.observe(m, seconds_at(m))


def test_the_base_is_the_line_s_intercept_over_its_slope_once_two_row_counts_have_enough_steps() -> None:
    cost = StepCost()
    assert cost.base_rows == PRIOR_BASE_ROWS
    timed(cost, lambda m: (3.0 + 1.5 * m) / 1000, [1], 4 * MIN_STEPS)
    assert cost.base_rows == PRIOR_BASE_ROWS  # one row count is no line
    timed(cost, lambda m: (3.0 + 1.5 * m) / 1000, [5], MIN_STEPS - 1)
    assert cost.base_rows == PRIOR_BASE_ROWS  # the second has too few steps
    timed(cost, lambda m: (3.0 + 1.5 * m) / 1000, [5, 9], REFIT_EVERY)
    assert cost.base_rows == pytest.approx(2.0)  # 3 ms fixed, 1.5 ms a row


def test_rows_that_cost_nothing_give_the_largest_base_and_rows_that_cost_everything_the_smallest() -> None:
    free, proportional, cheaper = StepCost(), StepCost(), StepCost()
    timed(free, lambda m: 0.005, [1, 8, 16], 2 * REFIT_EVERY)  # a GPU's decode steps
    timed(proportional, lambda m: 0.002 * m, [1, 8, 16], 2 * REFIT_EVERY)
    timed(cheaper, lambda m: 0.010 - 0.0001 * m, [1, 8, 16], 2 * REFIT_EVERY)
    assert free.base_rows == MAX_BASE_ROWS
    assert proportional.base_rows == MIN_BASE_ROWS
    assert cheaper.base_rows == MAX_BASE_ROWS


def test_each_row_count_s_time_is_an_average_that_follows_the_latest_steps() -> None:
    cost = StepCost()
    timed(cost, lambda m: (2.0 + m) / 1000, [1, 3], 4 * REFIT_EVERY)
    assert cost.base_rows == pytest.approx(2.0)
    cost.observe(3, 1.0)  # one step held up for a second moves its average by a tenth of it, not to it
    assert cost._ms[3] == pytest.approx(5.0 + 0.1 * (1000.0 - 5.0))
    timed(cost, lambda m: (8.0 + m) / 1000, [1, 3], 8 * REFIT_EVERY)  # the machine got slower
    assert cost.base_rows == pytest.approx(8.0, rel=1e-3)


def test_steps_without_rows_or_a_time_are_not_counted() -> None:
    cost = StepCost()
    for rows, seconds in ((0, 0.01), (2, 0.0), (2, -1.0), (2, math.nan), (2, math.inf)):
        cost.observe(rows, seconds)
    assert cost._steps == {} and cost.base_rows == PRIOR_BASE_ROWS


def test_the_line_weighs_each_point_and_needs_two_row_counts() -> None:
    assert base_from_line([(1, 5.0, 1)]) is None
    assert base_from_line([(2, 5.0, 1), (2, 7.0, 3)]) is None
    assert base_from_line([(1, 3.0, 1), (3, 5.0, 1)]) == pytest.approx(2.0)
    # a third point off the line pulls it in proportion to its weight
    light = base_from_line([(1, 3.0, 10), (3, 5.0, 10), (5, 9.0, 1)])
    heavy = base_from_line([(1, 3.0, 10), (3, 5.0, 10), (5, 9.0, 10)])
    assert heavy < light < 2.0
