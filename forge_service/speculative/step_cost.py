"""What a decode step costs by its rows, measured on the engine's own steps.

Drafting weighs the row each drafted token adds to a step against what a plain token costs
(Scheduler._draft_room): with M rows a step costs about (base + M) rows' worth, where `base` is
the part that does not grow with the rows (reading the weights, where the step is bound by it;
launching it; the step's Python). That part differs by orders of magnitude between machines: on
a 2-core CPU a row costs a sizeable share of a step, on a GPU a decode step of 16 rows takes about
the time of one. So, unless SpeculativeConfig.spec_step_base_rows fixes it, the scheduler fits it
to its decode steps' times: an average per row count, and a line through them.
"""
from __future__ import annotations

import math

PRIOR_BASE_ROWS = 2.2  # until measured: the CPU backend, default model, 2 cores (bench/speculative.py --step-rows)
MIN_BASE_ROWS = 0.25  # steps whose time grows in proportion to their rows: drafts must be near-certain
MAX_BASE_ROWS = 256.0  # steps whose time does not grow with their rows: drafts are (nearly) free
STEP_WEIGHT = 0.1  # each step's share in its row count's average: the older steps fade
MIN_STEPS = 8  # steps a row count needs before its average takes part in the line
MAX_POINT_WEIGHT = 32  # the most steps' weight one row count's average gets in the line
REFIT_EVERY = 16  # steps between fits


class StepCost:
    """Decode steps' times by their row counts, and the fixed part of a step in rows' worth."""

    def __init__(self, prior: float = PRIOR_BASE_ROWS) -> None:
        self.prior = prior
        self._ms: dict[int, float] = {}  # rows -> average step time (ms)
        self._steps: dict[int, int] = {}  # rows -> steps seen
        self._since_fit = 0
        self._base: float | None = None

    def observe(self, rows: int, seconds: float) -> None:
        """A decode step (no prefill in it) of `rows` rows, drafts included, took `seconds`."""
        if rows < 1 or not (seconds > 0 and math.isfinite(seconds)):
            return
        ms, average = 1000.0 * seconds, self._ms.get(rows)
        self._ms[rows] = ms if average is None else average + STEP_WEIGHT * (ms - average)
        self._steps[rows] = self._steps.get(rows, 0) + 1
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._since_fit = 0
            self._base = self.fit()

    @property
    def base_rows(self) -> float:
        """The fixed part of a step in rows' worth: the latest fit, or the prior before one."""
        return self.prior if self._base is None else self._base

    def fit(self) -> float | None:
        """The base of the row counts with MIN_STEPS steps each (base_from_line; each weighted by its
        steps, up to MAX_POINT_WEIGHT). None until there are two of them."""
        return base_from_line([(rows, ms, min(self._steps[rows], MAX_POINT_WEIGHT))
                               for rows, ms in self._ms.items() if self._steps[rows] >= MIN_STEPS])


def base_from_line(points: list[tuple[float, float, float]]) -> float | None:
    """intercept / slope of the weighted least-squares line through (rows, step time, weight) points,
    bounded to [MIN_BASE_ROWS, MAX_BASE_ROWS]; MAX_BASE_ROWS where the time does not grow with the
    rows. None for fewer than two row counts."""
    if len({rows for rows, _, _ in points}) < 2:
        return None
    total = sum(w for _, _, w in points)
    mean_rows = sum(w * m for m, _, w in points) / total
    mean_time = sum(w * t for _, t, w in points) / total
    spread = sum(w * (m - mean_rows) ** 2 for m, _, w in points)
    slope = sum(w * (m - mean_rows) * (t - mean_time) for m, t, w in points) / spread
    if not slope > 0:  # rows cost nothing measurable
        return MAX_BASE_ROWS
    return min(MAX_BASE_ROWS, max(MIN_BASE_ROWS, (mean_time - slope * mean_rows) / slope))
