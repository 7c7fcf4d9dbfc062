"""What each unit would cost the budget at each precision: measured one unit at a time, or apportioned by SQNR.

``measured``: one quality-pass variant per unit and precision, the model with only that unit cast; its end-to-end
figure (mean KL, or perplexity points) is the unit's contribution. Exact for the unit alone, and costs one model
forward per variant over the held-out tokens.

``sqnr``: one variant per precision, every unit cast at once; its figure is shared out over the units in proportion
to their output noise, ``sum over members of 10**(-SQNR/10)`` from the calibration's meter. A model forward per
precision only; the verification of the whole plan (and its back-off) catches what the apportioning gets wrong.

``auto``: measured while that takes at most :data:`AUTO_MEASURED_VARIANTS` variants, else sqnr.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from converters.plan.candidates import BF16, Unit, recipe_of
from converters.quality import measure_qualities, recipe_layer_casts

__all__ = ["SENSITIVITIES", "AUTO_MEASURED_VARIANTS", "plan_casts", "measure_variants", "budget_figure",
           "unit_contributions"]

SENSITIVITIES = ("auto", "measured", "sqnr")
AUTO_MEASURED_VARIANTS = 64
#: variants measured in one quality pass (each keeps its own hidden states beside the reference's)
_VARIANTS_PER_PASS = 32


def plan_casts(assignment: Mapping[str, str], units: Mapping[str, Unit]) -> dict[str, Any]:
    """The quality pass's casts of a plan: each unit's members under its precision's recipe (bf16: none)."""
    casts: dict[str, Any] = {}
    for name, precision in assignment.items():
        if precision != BF16:
            casts.update(recipe_layer_casts(recipe_of(precision), units[name].members))
    return casts


def measure_variants(source: Any, variants: Mapping[str, Mapping[str, Any]], quality: Mapping[str, Any]
                     ) -> dict[str, Any]:
    """Each variant's QualityFigures, :data:`_VARIANTS_PER_PASS` variants to a layer-sequential pass."""
    names, figures = list(variants), {}
    for start in range(0, len(names), _VARIANTS_PER_PASS):
        chunk = {name: variants[name] for name in names[start:start + _VARIANTS_PER_PASS]}
        figures.update(measure_qualities(source, chunk, **quality))
    return figures


def budget_figure(target: str, figures: Any) -> float:
    """The budgeted figure of a measurement: mean KL, or perplexity points over the source's."""
    if target == "max_ppl_increase":
        return figures.perplexity - figures.perplexity_reference
    return figures.kl_mean


def _noise(unit: Unit, precision: str, sqnr: Mapping[str, Mapping[str, Any]]) -> float | None:
    values = [sqnr.get(member, {}).get(precision) for member in unit.members]
    if any(value is None for value in values):
        return None
    return sum(10.0 ** (-value / 10.0) for value in values)


def unit_contributions(mode: str, source: Any, units: Mapping[str, Unit], fits: Mapping[str, Sequence[str]],
                       sqnr: Mapping[str, Mapping[str, Any]], quality: Mapping[str, Any], target: str
                       ) -> tuple[dict[str, dict[str, float]], str]:
    """unit -> precision -> contribution to the budgeted figure, and the mode used (``auto`` resolved)."""
    pairs = [(name, p) for name, options in fits.items() for p in options if p != BF16]
    if mode == "auto":
        mode = "measured" if len(pairs) <= AUTO_MEASURED_VARIANTS else "sqnr"
    out: dict[str, dict[str, float]] = {name: {} for name in units}
    if mode == "measured":
        variants = {f"{name}|{p}": plan_casts({name: p}, units) for name, p in pairs}
        for key, figures in measure_variants(source, variants, quality).items():
            name, precision = key.split("|")
            out[name][precision] = round(budget_figure(target, figures), 8)
        return out, mode
    precisions = sorted({p for _, p in pairs})
    variants = {p: plan_casts({name: p for name, options in fits.items() if p in options}, units) for p in precisions}
    whole = {p: budget_figure(target, figures) for p, figures in measure_variants(source, variants, quality).items()}
    for p in precisions:
        members = [name for name, options in fits.items() if p in options]
        noise = {name: _noise(units[name], p, sqnr) for name in members}
        known = [value for value in noise.values() if value is not None]
        fallback = sum(known) / len(known) if known else 1.0  # a unit the meter saw no data for: the average
        total = sum(value if value is not None else fallback for value in noise.values()) or 1.0
        for name in members:
            share = (noise[name] if noise[name] is not None else fallback) / total
            out[name][p] = round(whole[p] * share, 8)
    return out, mode
