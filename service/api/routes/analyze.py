"""/v1/analyze: the FP8 eligibility report of a model, computed synchronously on the meta device; with a short
calibration, each layer's quantization error (SQNR) under one or several recipes. The models are built in the
analysis processes of ``service.api.analyze_pool``, started with the app."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from service.api import operations
from service.api.analyze_pool import AnalysisPool, model_checks
from service.api.deps import SettingsDep
from service.api.routes import error_responses
from service.api.schemas import AnalyzeCreate
from service.workers.child import thread_budget

__all__ = ["ModelChecksDep", "router"]


@asynccontextmanager
async def _analysis_processes(app: FastAPI) -> AsyncIterator[None]:
    settings = app.state.settings
    pool = AnalysisPool(workers=settings.analyze_workers, queue_depth=settings.analyze_queue_depth,
                        timeout_s=settings.analyze_timeout_s,
                        threads=thread_budget(None, conversions=settings.analyze_workers))
    app.state.analysis_pool = pool
    app.state.model_checks = checks = model_checks()  # POST /v1/jobs's too
    try:
        yield
    finally:
        pool.close()
        checks.close()


async def _get_pool(request: Request) -> AnalysisPool:
    return request.app.state.analysis_pool


async def _get_checks(request: Request) -> AnalysisPool:
    return request.app.state.model_checks


#: The processes that check a local model's files (config, index, headers) before a job or an analysis.
ModelChecksDep = Annotated[AnalysisPool, Depends(_get_checks)]


router = APIRouter(prefix="/v1", tags=["analyze"], lifespan=_analysis_processes)


@router.post("/analyze", operation_id="analyzeModel", response_model=dict[str, Any],
             responses=error_responses(400, 413, 422, 503))
async def analyze_model(
    body: AnalyzeCreate, settings: SettingsDep, pool: Annotated[AnalysisPool, Depends(_get_pool)],
    checks: ModelChecksDep,
) -> Response:
    """Which Linear layers would be converted, and why the others would not (no weights are loaded).

    With `calibration`, `compare_recipes` or `min_sqnr_db`, the weights are loaded and a short calibration runs
    in the request: each eligible layer gets its SQNR (dB) under the recipe, and the recipes compared side by side.

    The model is built in one of the server's analysis processes: when all are busy and the queue before them is
    full the answer is 503 `analyze_busy` with `Retry-After`; an analysis that runs past the server's time bound,
    or whose process dies, is 503 `analysis_aborted`.
    """
    # the analysis process sends the report as JSON already: the event loop only passes it on
    return Response(await operations.analyze(settings, body, pool, checks), media_type="application/json")
