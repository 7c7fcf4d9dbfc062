"""A conversion job's plan: made when the request asks one (``plan``), written into the artifact's ``plan/``, with
the plan's mixed-precision serving checkpoints in ``plan/compressed-tensors-mixed/`` and ``plan/modelopt-mixed/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from converters.model.checkpoint import weight_files
from converters.model.sources import confinement_for, model_dtype
from converters.plan.candidates import BF16
from converters.plan.emit import PLAN_DIR, write_plan_files
from converters.plan.mixed_export import MIXED_LAYOUTS, MixedLayout, not_expressible, write_mixed_checkpoint
from converters.plan.planner import make_plan
from converters.plan.settings import PlanSettings
from converters.quality import QualityUnavailable
from converters.serving.selection import ServingSelection, set_input_amax

__all__ = ["plan_for_job"]


def plan_for_job(run: Any, staging: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The report's ``plan`` block and the files written for it (none without a ``plan`` in the request).

    The job's calibration measured every candidate's SQNR (``plan_compare_recipes``); the plan adds its quality
    passes (:func:`converters.plan.planner.make_plan`) on the job's layer selection. A model the quality pass cannot
    score (no LM head, no tokenizer) gets a block that says why, and a warning; the artifact is written all the same.
    The block's ``mixed_checkpoints`` says, per layout, where the mixed serving checkpoint was written, or why not.
    """
    if run.request.plan is None:
        return None, []
    settings = PlanSettings.from_dict(run.request.plan)
    try:
        plan = make_plan(run.report, run.request.model, settings, run.sources,
                         quality_texts=getattr(run.request, "quality_texts", None))
    except QualityUnavailable as exc:
        run.warn(f"no precision plan: {exc.message}")
        return {"made": False, "reason": exc.message, "settings": settings.to_dict()}, []
    files, notes = write_plan_files(plan, staging, getattr(run.resolved.config, "model_type", None))
    mixed, mixed_files = {}, []
    input_amax = _input_amax(run, plan)
    for layout in MIXED_LAYOUTS:
        mixed[layout.name], written = _mixed_checkpoint(run, layout, plan, input_amax, staging)
        mixed_files += written
    return {"made": True, **plan, "files": [*files, *mixed_files], "not_expressible": notes,
            "mixed_checkpoints": mixed}, [*files, *mixed_files]


def _input_amax(run: Any, plan: dict[str, Any]) -> dict[str, float]:
    """Each planned Linear's calibrated input amax, the largest of its fused group (the serving exports' rule)."""
    quantized = ServingSelection(format="plan", quantized={row["path"]: row["path"] for row in plan["layers"]
                                                           if row["precision"] != BF16})
    set_input_amax(quantized, run.report, run.calibration.amax)
    return quantized.input_amax


def _mixed_checkpoint(run: Any, layout: MixedLayout, plan: dict[str, Any], input_amax: dict[str, float],
                      staging: Path) -> tuple[dict[str, Any], list[str]]:
    """The plan's checkpoint in ``layout`` from the job's calibration; an all-bf16 plan, or one with a precision the
    layout has no writer for, gets none, and the reason."""
    if all(row["precision"] == BF16 for row in plan["layers"]):
        return {"written": False, "reason": "every layer is bf16: the source checkpoint is the plan"}, []
    left = not_expressible(plan, layout)
    if left:
        reason = (f"{layout.name} holds {', '.join(layout.serving_of)} layers; "
                  f"{', '.join(f'{len(paths)} {precision}' for precision, paths in left.items())} layer(s) have no "
                  "writer in it (their single-format serving exports do)")
        return {"written": False, "reason": reason}, []
    source = run.resolved.directory
    files = weight_files(source)
    if run.resolved.checkpoint.stored is not None:  # a quantized source: from the artifact's dequantized files
        files = [staging / path.name for path in files]
    written = write_mixed_checkpoint(layout, plan, source, files, staging / PLAN_DIR / layout.name,
                                     model_dtype(run.resolved.config), confinement_for(run.sources),
                                     on_disk_name=run.resolved.checkpoint.on_disk_name, input_amax=input_amax,
                                     check_stop=run.check_stop)
    names = [f"{PLAN_DIR}/{layout.name}/{name}" for name in written]
    return {"written": True, "directory": f"{PLAN_DIR}/{layout.name}", "files": names}, names
