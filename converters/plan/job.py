"""A conversion job's plan: made when the request asks one (``plan``), written into the artifact's ``plan/``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from converters.plan.emit import write_plan_files
from converters.plan.planner import make_plan
from converters.plan.settings import PlanSettings
from converters.quality import QualityUnavailable

__all__ = ["plan_for_job"]


def plan_for_job(run: Any, staging: Path) -> tuple[dict[str, Any] | None, list[str]]:
    """The report's ``plan`` block and the files written for it (none without a ``plan`` in the request).

    The job's calibration measured every candidate's SQNR (``plan_compare_recipes``); the plan adds its quality
    passes (:func:`converters.plan.planner.make_plan`) on the job's layer selection. A model the quality pass cannot
    score (no LM head, no tokenizer) gets a block that says why, and a warning; the artifact is written all the same.
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
    return {"made": True, **plan, "files": files, "not_expressible": notes}, files
