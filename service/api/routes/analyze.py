"""/v1/analyze: the FP8 eligibility report of a model, computed synchronously on the meta device; with a short
calibration, each layer's quantization error (SQNR) under one or several recipes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from service.api import operations
from service.api.deps import SettingsDep
from service.api.routes import error_responses
from service.api.schemas import AnalyzeCreate

__all__ = ["router"]

router = APIRouter(prefix="/v1", tags=["analyze"])


@router.post("/analyze", operation_id="analyzeModel", responses=error_responses(400, 413, 422, 503))
def analyze_model(body: AnalyzeCreate, settings: SettingsDep) -> dict[str, Any]:
    """Which Linear layers would be converted, and why the others would not (no weights are loaded).

    With `calibration`, `compare_recipes` or `min_sqnr_db`, the weights are loaded and a short calibration runs
    in the request: each eligible layer gets its SQNR (dB) under the recipe, and the recipes compared side by side.
    """
    return operations.analyze(settings, body)
