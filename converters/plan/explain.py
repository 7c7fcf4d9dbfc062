"""Why a plan gave a unit its precision, in one sentence built from the figures the search used."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from converters.plan.candidates import BF16, Unit

__all__ = ["explain_unit"]

_FIGURE = {"target_kl": "KL", "max_ppl_increase": "perplexity +"}


def _sqnr(unit: Unit, precision: str, sqnr: Mapping[str, Mapping[str, Any]]) -> float | None:
    values = [sqnr.get(member, {}).get(precision) for member in unit.members]
    return None if not values or any(v is None for v in values) else min(values)


def _cost(target: str, value: float, shared: bool) -> str:
    return f"{_FIGURE[target]} {value:.3g}" + (" (its SQNR share of the all-layers figure)" if shared else "")


def explain_unit(unit: Unit, precision: str, steps: Sequence[Any], options: Sequence[str],
                 sqnr: Mapping[str, Mapping[str, Any]], contribution: Mapping[str, float], target: str,
                 limit: float, shared: bool = False) -> str:
    """The reason for ``unit``'s ``precision``: its measured SQNR / contribution, its bytes, the search's step.
    ``shared``: the contributions are the all-layers figure shared out by SQNR, not measured per unit."""
    candidates = [p for p in options if p != BF16]
    if not candidates:
        dims = ", ".join(f"{out}x{inp}" for out, inp in unit.shapes)
        return f"bf16: no format the GPU runs fits its shape ({dims})"
    saved = unit.bytes(BF16) - unit.bytes(precision)
    level = _sqnr(unit, precision, sqnr)
    at = f", output SQNR {level:.1f} dB" if level is not None else ""
    if target == "min_sqnr_db":
        if precision == BF16:
            best = max(candidates, key=lambda p: _sqnr(unit, p, sqnr) or -1.0)
            value = _sqnr(unit, best, sqnr)
            shown = f"{value:.1f} dB" if value is not None else "not measured"
            return f"bf16: no format keeps every member's output SQNR >= {limit:g} dB (best: {best}, {shown})"
        return (f"{precision}: the format saving the most for the objective whose output SQNR >= {limit:g} dB"
                f"{at}; saves {saved} bytes")
    taken = [step for step in steps if step.unit == unit.name]
    if precision == BF16:
        cheapest = min(candidates, key=lambda p: contribution.get(p, float("inf")))
        cost = _cost(target, contribution.get(cheapest, 0.0), shared)
        return f"bf16: its cheapest format, {cheapest}, adds {cost}; the budget went to units giving more for it"
    rank = ", ".join(f"{step.before}->{step.after}" for step in taken)
    return (f"{precision}: adds {_cost(target, contribution.get(precision, 0.0), shared)}{at}, saves {saved} bytes "
            f"of {unit.bytes(BF16)}; search steps {rank}")
