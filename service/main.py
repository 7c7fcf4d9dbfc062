"""Assembles the FastAPI app: settings, store lifecycle, body limit, the one error handler, routers."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import Depends, FastAPI

from service.api.auth import KeyRing, require_caller
from service.api.error_responses import install_error_handler
from service.api.limits import BodyLimitMiddleware
from service.api.routes import analyze, artifacts, health, jobs
from service.api.schemas import ErrorBody
from service.artifacts import open_storage
from service.config import Settings, load_settings
from service.store import JobStore
from service.ui import install_ui
from service.workers.reaper import Reaper

__all__ = ["create_app"]

UNAUTHORIZED = {401: {"model": ErrorBody, "description": "No API key, or one this server does not accept."}}

logger = logging.getLogger(__name__)


def _version() -> str:
    try:
        return version("fp8forge")
    except PackageNotFoundError:
        return "0.0.0"


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the app; the store is opened (and stale jobs watched) while the app runs.

    Raises:
        SettingsError: ``settings`` omitted and the environment holds an invalid ``FP8FORGE_*`` value, or the
            API keys are malformed or missing while authentication is on.
    """
    settings = settings or load_settings()
    storage = open_storage(settings)
    keys = KeyRing.from_settings(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        storage.ensure()
        store = JobStore.from_settings(settings)
        reaper = Reaper(store, storage, settings.heartbeat_timeout_s, settings.heartbeat_interval_s,
                        sweep_every_s=settings.artifact_sweep_interval_s)
        app.state.store = store
        reaper.start()
        logger.info("fp8forge API ready (store %s, artifacts %s)", store.engine.url.render_as_string(),
                    storage if storage.remote else settings.jobs_dir)
        try:
            yield
        finally:
            reaper.stop()
            store.close()

    app = FastAPI(
        title="fp8forge", version=_version(), lifespan=lifespan,
        description="Convert Hugging Face models to FP8 checkpoints (safetensors): submit a job, follow it, "
                    "download the artifacts.",
    )
    app.state.settings = settings
    app.state.storage = storage
    app.state.keys = keys
    install_error_handler(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    for module in (jobs, artifacts, analyze):  # every /v1 route needs a key (unless auth is off)
        app.include_router(module.router, dependencies=[Depends(require_caller)], responses=UNAUTHORIZED)
    app.include_router(health.router)
    if settings.ui_enabled:
        install_ui(app)
    return app
