"""The per-layer precision plan: measure each unit's cost under each precision the GPU runs, choose greedily within
the target, verify the whole plan end to end, back off if the measurement exceeds the target.

1. One calibration (``converters.pipeline.sync_analysis``, layer by layer) measures every eligible Linear's output
   SQNR under every candidate recipe (the SQNR meter of ``converters.calibration.sensitivity``).
2. For a KL or perplexity target, one layer-sequential quality pass (``converters.quality``) measures, for every
   unit and candidate, the end-to-end figure of the model with only that unit cast: its contribution.
3. :func:`converters.plan.search.greedy_choice` spends the budget on the steps with the most objective per
   contribution (a min-SQNR target instead keeps, per unit, the best option whose SQNR meets it).
4. The chosen plan is measured as a whole, beside all-FP8 (current scaling) and the source; if its measured figure
   exceeds the target, the budget shrinks by the ratio and the search runs again (at most ``max_verifications``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from converters.errors import RequestError
from converters.model.sources import resolve_model_dir
from converters.plan.candidates import (
    BF16,
    PRECISIONS,
    Unit,
    decision_units,
    precisions_for,
    weight_bytes,
)
from converters.plan.contributions import (
    SENSITIVITIES,
    budget_figure,
    measure_variants,
    plan_casts,
    unit_contributions,
)
from converters.plan.explain import explain_unit
from converters.plan.search import Option, greedy_choice
from converters.plan.settings import GPUS, PlanSettings
from converters.quality import DEFAULT_MAX_TOKENS, DEFAULT_SEQ_LEN, load_source

__all__ = ["ALL_FP8", "make_plan", "plan_totals"]

#: the all-FP8 comparison: every planned unit under FP8 per-tensor current scaling
ALL_FP8 = "fp8-current"


def _value(unit: Unit, precision: str, objective: str, total_bytes: int) -> float:
    saved = unit.bytes(BF16) - unit.bytes(precision)
    if objective == "memory":
        return float(saved)
    # FP8/FP4 GEMM FLOPs first; the bytes saved (a fraction below one FLOP) only break ties between formats
    return float(unit.flops_per_token if precision != BF16 else 0) + saved / (total_bytes + 1)


def make_plan(report: Mapping[str, Any], model: str, settings: PlanSettings, sources: Any, *,
              quality_texts: list[str] | None = None, max_tokens: int = DEFAULT_MAX_TOKENS,
              seq_len: int = DEFAULT_SEQ_LEN, sensitivity: str = "auto", max_verifications: int = 4
              ) -> dict[str, Any]:
    """The plan block for ``model`` (a reference ``sources`` resolves) from its calibrated analysis ``report``.

    ``report`` is the analysis after calibration with the candidates compared (:func:`plan_compare_recipes`: a job
    whose request holds ``plan`` measures them; ``fp8forge plan`` asks for them); a layer it calls ineligible stays
    bf16. ``quality_texts`` are the held-out texts (None: the built-in held-out part). Raises RequestError
    (``plan.gpu``) for a GPU that runs no FP8 recipe, QualityUnavailable for a model the quality pass cannot score.
    """
    if sensitivity not in SENSITIVITIES:
        raise RequestError(f"sensitivity must be one of {', '.join(SENSITIVITIES)}, got {sensitivity!r}",
                           field="sensitivity")
    runs, not_run = precisions_for(settings.gpu)
    if not runs:
        raise RequestError(f"{settings.gpu} runs none of the FP8/FP4 recipes ({'; '.join(not_run.values())}): a plan "
                           "would keep every layer in bf16; choose a GPU of compute capability 8.9 or newer",
                           field="plan.gpu")
    sqnr = {row["path"]: {p: row["sqnr_db"].get(PRECISIONS[p], {}).get("output") for p in runs}
            for row in report.get("comparison", {}).get("layers", [])}
    units_list, kept = decision_units(report)
    units = {unit.name: unit for unit in units_list}
    fits = {name: [BF16, *(p for p in runs if unit.fits(p))] for name, unit in units.items()}
    target, limit = settings.target
    total_bytes = sum(unit.bytes(BF16) for unit in units_list)
    source = load_source(resolve_model_dir(model, sources, with_weights=True), sources)
    started = time.perf_counter()
    quality = {"texts": quality_texts, "max_tokens": max_tokens, "seq_len": seq_len}

    contributions: dict[str, dict[str, float]] = {}
    used = None
    if target == "min_sqnr_db":
        choice, steps = _by_sqnr(units, fits, sqnr, limit, settings.objective, total_bytes), []
        verifications = [_verify(source, units, choice, quality, target) | {"within": True}]
    else:
        contributions, used = unit_contributions(sensitivity, source, units, fits, sqnr, quality, target)
        options = {name: [Option(BF16, 0.0, 0.0)] + [
            Option(p, max(contributions[name][p], 0.0), _value(units[name], p, settings.objective, total_bytes))
            for p in fits[name][1:]] for name in units}
        choice, steps, verifications = _search_and_verify(source, units, options, contributions, quality, target,
                                                          limit, max_verifications)
    final = verifications[-1]
    dims = {layer["path"]: (layer["out_features"], layer["in_features"]) for layer in report["layers"]}
    layers = _layer_rows(units, {path: (why, dims[path]) for path, why in kept.items()}, choice, steps, fits, sqnr,
                         contributions, target, limit, shared=used == "sqnr")
    return {
        "settings": settings.to_dict(),
        "gpu": {"name": settings.gpu, "compute_capability": ".".join(map(str, GPUS[settings.gpu])),
                "precisions": [BF16, *runs], "not_run": not_run},
        "target": {"name": target, "value": limit, "met": final["within"]},
        "objective": settings.objective,
        "search": {"method": "greedy multiple-choice knapsack on per-unit contributions measured once per "
                             "precision, then the whole plan measured; budget shrunk and searched again while "
                             "the measurement exceeds the target" if target != "min_sqnr_db" else
                             "per unit, the best option for the objective whose every member's output SQNR "
                             "meets the target; the whole plan measured once",
                   "contributions": used, "units": len(units), "verifications": verifications},
        "layers": layers,
        "totals": plan_totals(layers),
        "measured": final["figures"],
        "seconds": round(time.perf_counter() - started, 3),
    }


def _by_sqnr(units: Mapping[str, Unit], fits: Mapping[str, list[str]], sqnr: Mapping[str, Mapping[str, Any]],
             limit: float, objective: str, total_bytes: int) -> dict[str, str]:
    choice = {}
    for name, unit in units.items():
        allowed = [p for p in fits[name][1:]
                   if all(sqnr.get(m, {}).get(p) is not None and sqnr[m][p] >= limit for m in unit.members)]
        choice[name] = max(allowed, key=lambda p: _value(unit, p, objective, total_bytes), default=BF16)
    return choice


def _search_and_verify(source: Any, units: Mapping[str, Unit], options: Mapping[str, list[Option]],
                       contributions: Mapping[str, Mapping[str, float]], quality: Mapping[str, Any], target: str,
                       limit: float, tries: int) -> tuple[dict[str, str], list[Any], list[dict[str, Any]]]:
    """Greedy within the budget, then the whole plan measured; while it measures above ``limit``, the budget shrinks
    by the overshoot (with a 10 % margin) and the search runs again. The last resort is all bf16 (the source)."""
    budget, verifications = limit, []
    for _ in range(tries):
        choice, steps = greedy_choice(options, budget)
        predicted = sum(max(contributions[name].get(p, 0.0), 0.0) for name, p in choice.items() if p != BF16)
        check = _verify(source, units, choice, quality, target,
                        verifications[0]["figures"]["all_fp8"] if verifications else None)
        check.update(budget=round(budget, 8), predicted=round(predicted, 8), within=check["measured"] <= limit)
        verifications.append(check)
        if check["within"]:
            return choice, steps, verifications
        budget = (predicted * limit / check["measured"] * 0.9) if check["measured"] > 0 and predicted > 0 else 0.0
    choice = dict.fromkeys(units, BF16)
    verifications.append(_verify(source, units, choice, quality, target, verifications[0]["figures"]["all_fp8"])
                         | {"budget": 0.0, "predicted": 0.0, "within": True})
    return choice, [], verifications


def _verify(source: Any, units: Mapping[str, Unit], choice: Mapping[str, str], quality: Mapping[str, Any],
            target: str, all_fp8: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The plan measured as a whole, beside all-FP8 (measured unless ``all_fp8`` holds its figures from an earlier
    try on the same tokens); the source's own figures stand for all-bf16."""
    variants = {"plan": plan_casts(choice, units)}
    if all_fp8 is None:
        variants["all_fp8"] = plan_casts(dict.fromkeys(units, ALL_FP8), units)
    figures = measure_variants(source, variants, quality)
    plan = figures["plan"]
    reference = {"perplexity": plan.perplexity_reference, "kl_mean": 0.0, "kl_max": 0.0, "top1_agreement": 1.0}
    return {"measured": round(budget_figure(target, plan), 8), "choice": dict(choice),
            "figures": {"plan": plan.to_dict(), "all_fp8": all_fp8 or figures["all_fp8"].to_dict(),
                        "all_bf16": reference}}


def _layer_rows(units: Mapping[str, Unit], kept: Mapping[str, tuple[str, tuple[int, int]]], choice: Mapping[str, str],
                steps: list[Any], fits: Mapping[str, list[str]], sqnr: Mapping[str, Mapping[str, Any]],
                contributions: Mapping[str, Mapping[str, float]], target: str, limit: float, *, shared: bool
                ) -> list[dict[str, Any]]:
    """One row per Linear: its unit, precision, why, its SQNR and its unit's contribution per precision, its cost."""
    rows = []
    candidates = list(next(iter(sqnr.values()), {}))  # every comparison row holds the GPU's precisions
    for name, unit in units.items():
        precision = choice[name]
        why = explain_unit(unit, precision, steps, fits[name], sqnr, contributions.get(name, {}), target, limit,
                           shared)
        excluded = {p: unit.excluded(p) for p in candidates}
        for member, shape in zip(unit.members, unit.shapes, strict=True):
            rows.append(_row(member, name, precision, why, shape, sqnr, contributions.get(name, {}), planned=True,
                             excluded={p: why_not[member] for p, why_not in excluded.items() if member in why_not}))
    for path, (reason, shape) in kept.items():
        alone = Unit(path, (path,), (shape,))
        rows.append(_row(path, path, BF16, reason, shape, sqnr, {}, planned=False,
                         excluded={p: alone.excluded(p)[path] for p in candidates if alone.excluded(p)}))
    return rows


def _row(path: str, unit: str, precision: str, why: str, shape: tuple[int, int], sqnr: Mapping[str, Any],
         contribution: Mapping[str, float], *, planned: bool, excluded: Mapping[str, str]) -> dict[str, Any]:
    """A plan row; a candidate whose shape rule (or fused group) excludes the layer has no SQNR, only its reason in
    ``excluded``: the plan could not choose it, so its figure would compare what will not happen."""
    out, inp = shape
    figures = {p: (None if p in excluded else value) for p, value in sqnr.get(path, {}).items()}
    return {"path": path, "unit": unit, "precision": precision, "planned": planned, "why": why,
            "out_features": out, "in_features": inp, "excluded": dict(excluded),
            "sqnr_db": figures, "contribution": dict(contribution),
            "bytes": weight_bytes(precision, out, inp), "bytes_bf16": weight_bytes(BF16, out, inp),
            "flops_per_token": 2 * out * inp}


def plan_totals(layers: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every Linear of the plan (those kept bf16 too): weight bytes against all-bf16, the FP8/FP4 share of their
    GEMM FLOPs, layers per precision."""
    flops = sum(row["flops_per_token"] for row in layers)
    low = sum(row["flops_per_token"] for row in layers if row["precision"] != BF16)
    counts: dict[str, int] = {}
    for row in layers:
        counts[row["precision"]] = counts.get(row["precision"], 0) + 1
    weight, bf16 = sum(row["bytes"] for row in layers), sum(row["bytes_bf16"] for row in layers)
    return {"weight_bytes": weight, "weight_bytes_bf16": bf16,
            "memory_ratio": round(weight / bf16, 4) if bf16 else None,
            "fp8_gemm_flop_share": round(low / flops, 4) if flops else 0.0, "layers_per_precision": counts,
            "not_planned_layers": sum(1 for row in layers if not row["planned"])}
