"""The pages under ``/ui`` and the one helper route they need besides the public API.

Pages are shells: they hold no job data, so they need no API key; their scripts fetch everything from
``/v1/...`` with the key the user entered (kept in the tab's sessionStorage). The only server-side work
here is reading an Accelerate ``config.yaml`` into a recipe object, which the API itself does not take.
"""

from __future__ import annotations

import hashlib
import logging
from functools import cache
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi import Path as PathParam
from fastapi.responses import HTMLResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from pydantic import BaseModel, ConfigDict, Field

from converters.errors import RecipeError
from converters.recipes import recipe_from_accelerate_yaml
from service.api.auth import require_caller
from service.ui.page_config import form_defaults, page_config

__all__ = ["router", "install_ui", "MAX_YAML_CHARS"]

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
STATIC_DIR = _HERE / "static"
#: An Accelerate config is a few hundred bytes; this leaves room for comments and nothing more.
MAX_YAML_CHARS = 65_536

# Pages load only their own files: no inline script, no eval (Alpine's CSP build), no other origin.
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                               "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}

router = APIRouter(prefix="/ui", include_in_schema=False)


@cache
def static_url(name: str) -> str:
    """``/ui/static/<name>?v=<content hash>``: a changed file gets a new URL, so no browser keeps a stale copy."""
    digest = hashlib.sha256((STATIC_DIR / name).read_bytes()).hexdigest()[:12]
    return f"/ui/static/{name}?v={digest}"


templates = Jinja2Templates(directory=_HERE / "templates")
templates.env.globals.update(static_url=static_url, page_config=page_config)


def _page(request: Request, template: str, **context: Any) -> HTMLResponse:
    return templates.TemplateResponse(request, template, context, headers=_HEADERS)


@router.get("")
def index() -> RedirectResponse:
    return RedirectResponse("/ui/jobs", status_code=307)


@router.get("/jobs", response_class=HTMLResponse)
def jobs_page(request: Request) -> HTMLResponse:
    return _page(request, "jobs.html", title="Jobs", nav="jobs")


@router.get("/jobs/new", response_class=HTMLResponse)
def new_job_page(request: Request) -> HTMLResponse:
    return _page(request, "new_job.html", title="New job", nav="new", form=form_defaults())


@router.get("/jobs/new/requantize", response_class=HTMLResponse)
def new_requantize_page(request: Request) -> HTMLResponse:
    return _page(request, "new_requantize.html", title="New requantize job", nav="requantize", form=form_defaults())


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(request: Request, job_id: Annotated[str, PathParam(max_length=64)]) -> HTMLResponse:
    return _page(request, "job.html", title=f"Job {job_id}", nav="jobs", job_id=job_id)


@router.get("/analyze", response_class=HTMLResponse)
def analyze_page(request: Request) -> HTMLResponse:
    return _page(request, "analyze.html", title="Analyze", nav="analyze", form=form_defaults())


class RecipeYamlCreate(BaseModel):
    """An Accelerate ``config.yaml`` as text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    yaml: str = Field(..., max_length=MAX_YAML_CHARS)


@router.post("/api/recipe-from-yaml", dependencies=[Depends(require_caller)])
def recipe_from_yaml(body: RecipeYamlCreate) -> dict[str, Any]:
    """The ``recipe`` object for ``POST /v1/jobs`` that an Accelerate config's ``fp8_config`` block stands for.

    Raises:
        RecipeError (422 ``invalid_recipe``, field ``yaml``): not YAML, no ``mixed_precision: fp8``, no
            ``fp8_config.backend``, or a bad recipe field (the message names it as ``fp8_config.<key>``).
    """
    try:
        recipe = recipe_from_accelerate_yaml(body.yaml)
    except RecipeError as exc:
        raise RecipeError(exc.message, field="yaml") from exc
    # the API takes the canonical fields only; unset ones take the same defaults there
    return {"recipe": {key: value for key, value in recipe.to_dict().items() if value is not None}}


def install_ui(app: FastAPI) -> None:
    """Serve the pages under ``/ui`` and their files under ``/ui/static``; ``/`` leads to them."""
    app.include_router(router)
    # what a browser pointed at the server's address should see (no part of the API, nor of its schema)
    app.add_api_route("/", lambda: RedirectResponse("/ui", status_code=307), include_in_schema=False)
    app.mount("/ui/static", StaticFiles(directory=STATIC_DIR), name="ui-static")
    logger.debug("web UI under /ui")
