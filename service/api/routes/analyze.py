"""/v1/analyze: the FP8 eligibility report of a model, computed synchronously on the meta device."""

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
    """Which Linear layers would be converted, and why the others would not (no weights are loaded)."""
    return operations.analyze(settings, body)
