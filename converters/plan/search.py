"""The search: per unit a few options (precision, predicted cost against the budget, value for the objective), and
a greedy multiple-choice knapsack over them.

Each unit's options are reduced to their upper convex hull in (cost, value): an option that costs more and gives
no more is dominated, and one whose step up is better per unit of cost than the step before it replaces that
step. The hull's steps, over all units, are then taken in order of value per cost while the budget allows; a step
that does not fit is passed over and the search goes on with the cheaper steps of other units. This is the
classic greedy for the multiple-choice knapsack: within one step of the LP optimum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Option", "Step", "greedy_choice"]


@dataclass(frozen=True)
class Option:
    precision: str
    cost: float  #: predicted contribution to the budgeted figure (KL, perplexity points); >= 0
    value: float  #: what the objective gains over bf16 (bytes saved, FP8 GEMM FLOPs); bf16 is 0


@dataclass(frozen=True)
class Step:
    """One move of a unit from one option to the next on its hull, taken by the search."""

    unit: str
    before: str
    after: str
    cost: float
    value: float

    @property
    def efficiency(self) -> float:
        return math.inf if self.cost <= 0 else self.value / self.cost


def _hull(options: Sequence[Option], start: str) -> list[Option]:
    """The upper convex hull of ``options`` from the free option ``start`` upwards (a free option that gives more
    than ``start`` is its first step, of cost 0)."""
    free = [option for option in options if option.precision == start]
    if not free:
        raise ValueError(f"the free option {start!r} is missing")
    ordered = sorted((o for o in options if o.precision != start), key=lambda o: (max(o.cost, 0.0), -o.value))
    kept: list[Option] = [free[0]]
    for option in ordered:
        if option.value <= kept[-1].value:
            continue  # dominated: costs as much or more and gives no more
        kept.append(option)
        while len(kept) >= 3 and _slope(kept[-3], kept[-2]) <= _slope(kept[-2], kept[-1]):
            del kept[-2]  # the middle step is worse per cost than the one after it
    return kept


def _slope(a: Option, b: Option) -> float:
    cost = max(b.cost, 0.0) - max(a.cost, 0.0)
    return math.inf if cost <= 0 else (b.value - a.value) / cost


def greedy_choice(options: Mapping[str, Sequence[Option]], budget: float, start: str = "bf16"
                  ) -> tuple[dict[str, str], list[Step]]:
    """Choose one option per unit so that the summed cost stays within ``budget`` and the summed value is large.

    ``options[unit]`` must hold the free option ``start`` (cost 0, value 0). Returns the choice and the steps
    taken, in the order taken (the reason each unit left ``start``).
    """
    steps: list[Step] = []
    for unit, unit_options in options.items():
        try:
            hull = _hull(unit_options, start)
        except ValueError as exc:
            raise ValueError(f"unit {unit}: {exc}") from None
        steps += [Step(unit, a.precision, b.precision, max(b.cost, 0.0) - max(a.cost, 0.0), b.value - a.value)
                  for a, b in zip(hull, hull[1:], strict=False)]
    steps.sort(key=lambda step: step.efficiency, reverse=True)
    choice = dict.fromkeys(options, start)
    spent, taken = 0.0, []
    for step in steps:
        if choice[step.unit] != step.before or spent + step.cost > budget:
            continue
        choice[step.unit] = step.after
        spent += step.cost
        taken.append(step)
    return choice, taken
