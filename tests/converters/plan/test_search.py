"""The plan's search: a greedy multiple-choice knapsack over each unit's convex hull of options."""

from __future__ import annotations

import itertools

import pytest

from converters.plan.search import Option, greedy_choice


def _options(*entries: tuple[str, float, float]) -> list[Option]:
    return [Option("bf16", 0.0, 0.0), *(Option(*entry) for entry in entries)]


def _best(options, budget):
    """The exact optimum by enumeration, for small cases."""
    names = list(options)
    best = (-1.0, None)
    for combo in itertools.product(*(options[name] for name in names)):
        if sum(o.cost for o in combo) <= budget and sum(o.value for o in combo) > best[0]:
            best = (sum(o.value for o in combo), combo)
    return best[0]


def test_the_budget_goes_to_the_most_value_per_cost_first():
    options = {"a": _options(("fp8", 1.0, 10.0), ("fp4", 3.0, 15.0)),  # fp4's step: 5 more for 2 more
               "b": _options(("fp8", 1.0, 4.0)),
               "c": _options(("fp8", 0.0, 2.0))}  # free: taken first whatever the budget
    choice, steps = greedy_choice(options, budget=2.0)
    assert choice == {"a": "fp8", "b": "fp8", "c": "fp8"}
    assert [(s.unit, s.after) for s in steps] == [("c", "fp8"), ("a", "fp8"), ("b", "fp8")]
    choice, _ = greedy_choice(options, budget=4.0)
    assert choice == {"a": "fp4", "b": "fp8", "c": "fp8"}  # 3 + 1 + 0 = 4


def test_a_dominated_or_non_convex_option_is_never_a_step():
    # "mid" costs 2 for 3 more than fp8, "top" 1 more for 6 more: the hull skips mid
    options = {"a": _options(("fp8", 1.0, 4.0), ("mid", 3.0, 7.0), ("top", 4.0, 13.0), ("worse", 5.0, 12.0))}
    choice, steps = greedy_choice(options, budget=10.0)
    assert choice == {"a": "top"} and [s.after for s in steps] == ["fp8", "top"]


def test_a_step_that_does_not_fit_is_passed_over_for_cheaper_ones():
    options = {"big": _options(("fp8", 5.0, 50.0)), "small": _options(("fp8", 1.0, 5.0))}
    choice, _ = greedy_choice(options, budget=3.0)
    assert choice == {"big": "bf16", "small": "fp8"}


@pytest.mark.parametrize("seed", range(20))
def test_greedy_stays_within_budget_and_near_the_optimum(seed):
    import random

    rng = random.Random(seed)
    options = {f"u{i}": _options(*((p, rng.uniform(0, 1), rng.uniform(0, 10)) for p in ("fp8", "mx", "fp4")))
               for i in range(4)}
    budget = rng.uniform(0.2, 2.0)
    choice, _ = greedy_choice(options, budget)
    picked = [next(o for o in options[u] if o.precision == p) for u, p in choice.items()]
    assert sum(o.cost for o in picked) <= budget + 1e-12
    # the multiple-choice greedy is within one option's value of the optimum
    largest = max(o.value for opts in options.values() for o in opts)
    assert sum(o.value for o in picked) >= _best(options, budget) - largest - 1e-9


def test_the_free_option_must_be_there():
    with pytest.raises(ValueError, match="free option"):
        greedy_choice({"a": [Option("fp8", 0.5, 1.0)]}, budget=1.0)
