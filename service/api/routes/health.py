"""Liveness, readiness and Prometheus metrics."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, PlainTextResponse

from service.api.deps import SettingsDep, StoreDep
from service.api.metrics import CONTENT_TYPE, render_metrics
from service.api.schemas import HealthPublic, ReadyPublic

__all__ = ["router"]

router = APIRouter(tags=["health"])


# A plain ``def`` on purpose: FastAPI runs it in the threadpool that serves the store reads and downloads, so a
# server whose threads are all stuck fails its liveness probe instead of passing it from the event loop.
@router.get("/healthz", operation_id="health")
def health() -> HealthPublic:
    """The process answers."""
    return HealthPublic(status="ok")


@router.get("/readyz", operation_id="ready", responses={503: {"model": ReadyPublic}})
def ready(store: StoreDep, settings: SettingsDep) -> JSONResponse:
    """Ready when the store answers within FP8FORGE_READY_TIMEOUT_S and at least one worker heartbeat is fresh
    (503 otherwise)."""
    workers = store.readiness(within_s=settings.ready_timeout_s, worker_timeout_s=settings.heartbeat_timeout_s)
    reachable = workers is not None
    body = ReadyPublic(ready=bool(workers), store=reachable, workers=workers or 0)
    return JSONResponse(body.model_dump(), status_code=200 if body.ready else 503)


@router.get("/metrics", operation_id="metrics", response_class=PlainTextResponse)
def metrics(store: StoreDep, settings: SettingsDep) -> PlainTextResponse:
    return PlainTextResponse(render_metrics(store, settings), media_type=CONTENT_TYPE)
