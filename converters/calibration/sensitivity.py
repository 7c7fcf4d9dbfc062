"""Per-layer quantization error under a recipe, and the layers it keeps in high precision.

For each calibrated layer (Linear or MoE expert GEMM unit) and recipe, three signal-to-quantization-noise
ratios, ``10 log10(sum(x**2) / sum((x - q(x))**2))`` in dB, where ``q`` casts as the recipe would
(:mod:`converters.casts.emulation`):

* ``weight``: the weight, ``[out, in]``, cast once;
* ``input``: the layer's calibration inputs (the tokens routed to it for an expert), every step pooled;
* ``output``: the layer's output computed in fp32 from the cast input and weight against the layer's own
  output (what the high-precision model computes: in fp32 for an fp32 model; for a bf16 model its bf16
  output, whose own rounding lies about 56 dB below the signal, a 0.01 dB effect on FP8's 20 to 35 dB),
  every step pooled (the bias, kept in high precision, cancels in the noise). Taking the layer's own output
  spares a second high-precision GEMM and an fp32 copy of the weight per call.

The sums are accumulated in the calibration hooks (``converters.calibration.amax``): no activation is kept.
TE delayed scaling casts an input with the scale its amax history holds *before* the step (the largest of
the last ``amax_history_len`` steps' amax, ``most_recent``: the last one; the first step, with no history,
uses its own amax as a seeded artifact would), so a step whose amax outgrows the history saturates here as
it would in training. Every other recipe scales from the tensor being cast.

``min_sqnr_db`` keeps every layer whose *output* SQNR under the job's recipe falls below it in high precision:
the report lists it with reason ``low_sqnr``, it is not converted and its calibration is not written. An
expert GEMM kind runs as one grouped GEMM (TE GroupedLinear, serving engines), so it is decided as a group:
by its lowest member. This module imports torch only inside the meter.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from converters.analysis.comparison import identical_groups, recipe_exclusions, why_identical
from converters.analysis.reasons import Reason
from converters.analysis.totals import refresh_totals
from converters.calibration.sqnr_meter import DEFAULT_ROWS_PER_LAYER, DelayedParams, RecipeCasts, SqnrMeter
from converters.casts.emulation import cast_spec
from converters.recipes.presets import _value, parse_compare_recipe, recipe_label
from converters.recipes.registry import recipe_from_dict

__all__ = [
    "SQNR_DEFINITION",
    "recipe_casts",
    "meter_for",
    "relabel_comparison",
    "report_sqnr",
    "exclude_low_sqnr",
]


SQNR_DEFINITION = ("10*log10(sum(x^2)/sum((x-q(x))^2)) dB; weight: the weight cast once; input: the calibration "
                   "inputs, all steps pooled; output: the output from the cast input and weight against the layer's "
                   "own output, all steps pooled; input and output on at most 32 token rows per call (the 8 "
                   "largest and an even spread of the others, weighted; scales from the whole input); 300 means "
                   "exact")

# Recipes whose fp8 scales are powers of two: TE Float8BlockScaling by default, torchao's rowwise recipes
_POW2_SCALES = {("te", "float8_block"), ("ao", "rowwise"), ("ao", "rowwise_with_gw_hp"), ("ao", "float8_training_op")}


def recipe_casts(recipe: Any, label: str | None = None) -> RecipeCasts:
    """The forward casts of ``recipe`` (its ``cast_formats()``)."""
    key = (_value(recipe.backend), _value(recipe.scaling))
    formats = recipe.cast_formats()
    weight, inp = formats["weight"], formats["input"]
    library = "torchao" if key[0] == "ao" else "te"
    pow2 = key in _POW2_SCALES and not getattr(recipe, "use_f32_scales", False)  # TE Float8BlockScaling's option
    options = {"library": library, "pow2_scales": pow2,
               "mx_rounding": _value(getattr(recipe, "scale_calculation_mode", "rceil")).lower()}
    delayed = None
    if key == ("te", "delayed"):
        delayed = DelayedParams(history_len=getattr(recipe, "amax_history_len", 1024),
                                algo=_value(getattr(recipe, "amax_compute_algo", "max")),
                                margin=getattr(recipe, "margin", 0))
    return RecipeCasts(label=label or recipe_label(recipe), recipe=recipe.to_dict(),
                       weight=cast_spec(weight, **options), input=cast_spec(inp, **options), delayed=delayed,
                       not_emulated=_not_emulated(recipe))


def _not_emulated(recipe: Any) -> tuple[str, ...]:
    """Recipe options that change the forward casts and that the emulation leaves out (said in the report)."""
    notes = []
    if _value(getattr(recipe, "nvfp4_4over6", "none")) != "none":
        notes.append("nvfp4_4over6 (per-block choice between two scales): emulated with the plain NVFP4 scale")
    if getattr(recipe, "row_scaled_activation", False):
        notes.append("row_scaled_activation: emulated with the plain NVFP4 activation scale")
    return tuple(notes)


def _unique(labels: Iterable[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        out.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return out


def meter_for(recipe: Any, compare: Sequence[Any] = (), extra: Sequence[RecipeCasts] = ()) -> tuple[SqnrMeter, str]:
    """A meter for the job's ``recipe`` and the ``compare`` entries, and the label of the job's recipe.

    Compare columns are named by their short names, made unique (``te-delayed#2``); an entry equal to the job's
    recipe is measured once, under the entry's name. ``extra`` casts (the serving formats') are measured too,
    under their own labels, outside the comparison table.
    """
    parsed = [parse_compare_recipe(item, f"compare_recipes[{index}]") for index, item in enumerate(compare)]
    names = _unique(item if isinstance(item, str) else recipe_label(parsed[index])
                    for index, item in enumerate(compare))
    casts = [recipe_casts(recipe_, name) for recipe_, name in zip(parsed, names, strict=True)]
    chosen = next((c for c in casts if c.recipe == recipe.to_dict()), None)
    if chosen is None:
        label = recipe_label(recipe)
        chosen = recipe_casts(recipe, label if label not in names else f"{label} (job)")
        casts.insert(0, chosen)
    # no cached weight casts: a layer-sequential calibration measures a layer in one flush (see SqnrMeter)
    meter = SqnrMeter([*casts, *extra], compared=names, rows_per_layer=DEFAULT_ROWS_PER_LAYER, cache_bytes=0)
    return meter, chosen.label


def relabel_comparison(report: dict[str, Any], labels: Sequence[str | None]) -> None:
    """Rename the comparison's columns in order (None keeps one's name), e.g. recipe files by their file names."""
    recipes = report["comparison"]["recipes"]
    old = [recipe["label"] for recipe in recipes]
    given = list(labels)[: len(old)] + [None] * (len(old) - len(labels))
    new = _unique(label or name for label, name in zip(given, old, strict=True))
    renamed = dict(zip(old, new, strict=True))
    for recipe in recipes:
        recipe["label"] = renamed[recipe["label"]]
    for row in report["comparison"]["layers"]:
        row["sqnr_db"] = {renamed[label]: value for label, value in row["sqnr_db"].items()}
    for group in report["comparison"].get("identical", []):
        group["labels"] = [renamed[label] for label in group["labels"]]
    job = report["sensitivity"]["recipe"]
    job["label"] = renamed.get(job["label"], job["label"])


def report_sqnr(report: dict[str, Any], meter: SqnrMeter, label: str, *, min_sqnr_db: float | None = None
                ) -> list[str]:
    """Write the measured SQNR into ``report``; with ``min_sqnr_db``, exclude the layers below it.

    Each measured layer gets ``sqnr_db`` under the job's recipe (``label``); ``report["sensitivity"]`` says how
    it was measured and what was excluded; with compared recipes, ``report["comparison"]`` holds the table.
    Returns the excluded paths (see :func:`exclude_low_sqnr`).
    """
    measured = set(meter.paths())
    casts = {c.label: c for c in meter.recipes}
    for layer in report["layers"]:
        if layer["path"] in measured:
            layer["sqnr_db"] = meter.result(layer["path"], label)
    excluded = exclude_low_sqnr(report, min_sqnr_db) if min_sqnr_db is not None else []
    report["sensitivity"] = {
        "measured": True, "recipe": casts[label].describe(), "definition": SQNR_DEFINITION, "min_sqnr_db": min_sqnr_db,
        "decided_by": "output", "excluded": excluded, "measured_layers": len(measured),
        "without_data": [path for path in meter.paths() if meter.result(path, label)["output"] is None],
    }
    if meter.compared:
        report["comparison"] = _comparison(report, meter, min_sqnr_db)
    return excluded


def _comparison(report: dict[str, Any], meter: SqnrMeter, min_sqnr_db: float | None) -> dict[str, Any]:
    """The table of compared recipes; a layer a recipe's shape rule keeps in high precision has no figure under it,
    only ``excluded`` (the analysis's reason code): it would not be converted (converters.analysis.comparison)."""
    measured = set(meter.paths())
    layers = [layer for layer in report["layers"] if layer["path"] in measured]
    recipes = [c.describe() for c in meter.recipes if c.label in meter.compared]
    for recipe in recipes:
        recipe["excluded"] = recipe_exclusions(layers, recipe_from_dict(recipe["recipe"]))
    rows = [{"path": layer["path"], "sqnr_db": {r["label"]: _figures(meter, layer["path"], r) for r in recipes}}
            for layer in layers]
    if min_sqnr_db is not None:
        for recipe in recipes:
            outputs = [(row["path"], row["sqnr_db"][recipe["label"]]["output"]) for row in rows]
            recipe["below_min_sqnr_db"] = [path for path, value in outputs if low_sqnr(value, min_sqnr_db)]
    by_label = {recipe["label"]: recipe for recipe in recipes}
    identical = [{"labels": group, "why": why_identical([by_label[label] for label in group])}
                 for group in identical_groups(rows, [recipe["label"] for recipe in recipes])]
    return {"recipes": recipes, "layers": rows, "identical": identical}


def _figures(meter: SqnrMeter, path: str, recipe: dict[str, Any]) -> dict[str, Any]:
    reason = recipe["excluded"].get(path)
    if reason is None:
        return meter.result(path, recipe["label"])
    return {"weight": None, "input": None, "output": None, "excluded": reason}


def low_sqnr(output_db: float | None, min_sqnr_db: float) -> bool:
    """Whether a layer whose output SQNR is ``output_db`` stays in high precision under ``min_sqnr_db``."""
    return output_db is not None and output_db < min_sqnr_db


def exclude_low_sqnr(report: dict[str, Any], min_sqnr_db: float) -> list[str]:
    """Mark eligible layers whose output SQNR is below ``min_sqnr_db`` as not eligible, reason ``low_sqnr``.

    An expert GEMM kind (``<experts>.<gemm>`` over all experts) is decided by its lowest member and excluded
    whole. Fused groups and totals are brought up to date. Returns the excluded paths in report order.
    """
    by_path = {layer["path"]: layer for layer in report["layers"]}

    def low(path: str) -> bool:
        return low_sqnr((by_path[path].get("sqnr_db") or {}).get("output"), min_sqnr_db)

    doomed = {layer["path"] for layer in report["layers"]
              if layer["eligible"] and "expert" not in layer and low(layer["path"])}
    for group in report["fused_groups"]:
        members = [by_path[m] for m in group["members"]]
        if all("expert" in m for m in members) and any(m["eligible"] and low(m["path"]) for m in members):
            doomed.update(m["path"] for m in members if m["eligible"])
    excluded = [layer["path"] for layer in report["layers"] if layer["path"] in doomed]
    for path in excluded:
        by_path[path]["eligible"] = False
        by_path[path]["reasons"].append(Reason.LOW_SQNR.value)
    if excluded:
        _refresh(report, by_path)
    return excluded


def _refresh(report: dict[str, Any], by_path: dict[str, dict[str, Any]]) -> None:
    for group in report["fused_groups"]:
        group["eligible_members"] = [m for m in group["members"] if by_path[m]["eligible"]]
        group["partly_eligible"] = 0 < len(group["eligible_members"]) < len(group["members"])
    refresh_totals(report)
