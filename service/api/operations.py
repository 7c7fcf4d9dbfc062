"""What the routes do, as plain functions: submit, cancel and delete jobs, analyze a model reference.

Routes parse and serialise; everything with a rule in it lives here so the CLI and tests can call it too.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from functools import partial
from typing import Any

from converters import errors
from converters.analysis import include_check
from converters.model import sources as model_sources
from converters.pipeline.request import SYNC_DEFAULTS, CalibrationSettings, ConversionRequest, check_sync_calibration
from service.api.analyze_pool import AnalysisPool, as_json
from service.api.auth import Caller
from service.api.schemas import AnalyzeCreate, JobCreate
from service.artifacts import ArtifactStorage
from service.config import Settings
from service.errors import InvalidRequest, InvalidTransition
from service.executors.slurm_options import check_slurm_options, conversion_fields
from service.jobs import Job, JobStatus
from service.store import JobStore

__all__ = ["check_request", "submit_job", "cancel_job", "delete_job", "analyze"]


def check_request(request: Mapping[str, Any], settings: Settings) -> None:
    """Validate a conversion request as far as possible without reading the model's files (the reference, the
    recipe, the calibration); :func:`submit_job` has the files checked in an analysis process.

    Raises:
        converters.errors.Fp8ForgeError: with ``field`` naming the culprit (HTTP 422).
    """
    check_slurm_options(request, settings)
    sources = model_sources.ModelSourceOptions(**settings.model_sources())
    _check_reference(request["model"], sources)
    try:
        ConversionRequest.from_dict(conversion_fields(request))
    except (errors.RecipeError, errors.CalibrationDataError) as exc:
        # name the field by its full path in the request body
        section = "recipe" if isinstance(exc, errors.RecipeError) else "calibration"
        if exc.field and not exc.field.startswith((section, "model", "include", "exclude")):
            exc.field = f"{section}.{exc.field}"
        raise


def _check_reference(ref: str, sources: Any) -> None:
    try:
        model_sources.validate_model_reference(ref, sources)
    except errors.ModelReferenceError as exc:
        exc.field = exc.field or "model"
        raise


async def _check_model_files(checks: AnalysisPool, ref: str, sources: Any, include: tuple[str, ...] = ()) -> None:
    """A local model's config.json against ``sources.config_limits``, and the include patterns against its stored
    tensor names, read in one of ``checks``' processes (``include_check.check_local_model``): every read is
    bounded, but a bounded read of a client's file still costs up to a second and a hundred megabytes, which the
    API's threads and memory must not pay. A config of 10,000 layers is refused in milliseconds, not built.

    Raises:
        ModelConfigError (422): naming the file, the field or count, the limit and the fix. PatternError (422).
        AnalyzeBusy, AnalysisAborted (503).
    """
    await checks.run(include_check.check_local_model, ref, sources, include)


async def submit_job(
    store: JobStore, settings: Settings, body: JobCreate, idempotency_key: str | None, caller: Caller,
    checks: AnalysisPool,
) -> Job:
    """Validate and queue a conversion job for ``caller``, honouring ``Idempotency-Key``; the model's files are
    checked in one of ``checks``' processes.

    Raises:
        Fp8ForgeError (422), InvalidRequest (422), IdempotencyConflict (409), TooManyJobs (429),
        AnalyzeBusy or AnalysisAborted (503).
    """
    from anyio import to_thread

    if idempotency_key is not None and not (idempotency_key.isascii() and idempotency_key.isprintable()):
        raise InvalidRequest("Idempotency-Key must be printable ASCII", field="Idempotency-Key")
    request = body.to_request()
    await to_thread.run_sync(check_request, request, settings)  # the reference's checks list its directory
    sources = model_sources.ModelSourceOptions(**settings.model_sources())
    await _check_model_files(checks, request["model"], sources, tuple(request.get("include") or ()))
    digest = hashlib.sha256(json.dumps(request, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    job, _ = await to_thread.run_sync(partial(
        store.create_job, request, request_hash=digest, idempotency_key=idempotency_key or None,
        max_attempts=settings.max_attempts, owner=caller.owner, max_queued=settings.max_queued_jobs_per_key))
    return job


def cancel_job(store: JobStore, job_id: str) -> Job:
    """Cancel a job: a queued one at once, a running one via ``cancelling`` (its worker stops it).

    Raises:
        JobNotFound (404); InvalidTransition (409) when the job has already finished.
    """
    for _ in range(10):
        job = store.get_job(job_id)
        if job.status is JobStatus.CANCELLING:
            return job
        target = JobStatus.CANCELLED if job.status is JobStatus.QUEUED else JobStatus.CANCELLING
        try:
            return store.set_status(job_id, target, event={"reason": "cancel requested"})
        except InvalidTransition:
            if store.get_job(job_id).status is job.status:
                raise  # a real refusal, not a race with a worker claiming it
    raise InvalidTransition(f"job {job_id} kept changing; try again")


def delete_job(store: JobStore, storage: ArtifactStorage, job_id: str) -> None:
    """Delete a finished job and its artifacts (files on disk, or every object of the job in the store).

    The row goes first, so no reader resolves a name to the files being removed; files a store could not
    remove just then are the sweeper's once no row points at them.

    Raises:
        JobNotFound (404); InvalidTransition (409) while the job is queued or running.
    """
    store.delete_job(job_id)
    storage.remove(job_id)


async def analyze(settings: Settings, body: AnalyzeCreate, pool: AnalysisPool, checks: AnalysisPool) -> bytes:
    """The eligibility report of a model reference (as JSON), built on the meta device (no weights are read).

    With a calibration (``body.calibrates()``) the weights are loaded layer by layer and a short calibration
    measures each eligible layer's SQNR (``converters.pipeline.sync_analysis.calibrated_analysis``). The reference
    and the calibration bounds are checked here, a local model's config in one of ``checks``' processes; the model
    is built in one of ``pool``'s processes (``converters.pipeline.sync_analysis.analysis_report``), never in the
    API's.

    Raises:
        Fp8ForgeError: bad reference (422), model not found (422), a config out of bounds (422), bad calibration
            or recipe names (422), a model too large to calibrate synchronously (422), backend problems (503).
        AnalyzeBusy (503): every analysis process is busy and the queue is full.
        AnalysisAborted (503): the analysis process died or ran past ``analyze_timeout_s``.
    """
    from anyio import to_thread

    sources = model_sources.ModelSourceOptions(**settings.model_sources())
    # the checks list the model directory: a thread's work, though short, not the event loop's
    request = await to_thread.run_sync(_check_analysis, body, sources)
    await _check_model_files(checks, body.model, sources)
    options = {"ref": body.model, "backend": _analysis_backend(body), "include": tuple(body.include),
               "exclude": tuple(body.exclude), "skip_first_last": body.skip_first_last,
               "convert_router_gates": body.convert_router_gates, "recipe": body.recipe_json()}
    return await pool.run(as_json, _analysis_report, sources, options, request)


def _analysis_backend(body: AnalyzeCreate) -> str:
    """The backend of an analysis: its recipe's; a ``backend`` sent beside a recipe of another backend is refused."""
    recipe = body.recipe_json()
    if recipe is None:
        return body.backend
    if "backend" in body.model_fields_set and body.backend != recipe["backend"]:
        raise InvalidRequest(f"backend is {body.backend!r} but recipe.backend is {recipe['backend']!r}: send one "
                             "of them, or make them the same", field="backend")
    return recipe["backend"]


def _check_analysis(body: AnalyzeCreate, sources: Any) -> Any:
    """Check what can be checked without reading the model's files; returns the calibrated analysis's request, if
    any."""
    _check_reference(body.model, sources)
    return _calibration_request(body) if body.calibrates() else None


def _calibration_request(body: AnalyzeCreate) -> Any:
    """The conversion request a calibrated analysis runs, its calibration checked against the synchronous bounds."""
    given = body.calibration.model_dump(exclude_none=True) if body.calibration is not None else {}
    if "texts" in given:
        given["texts"] = tuple(given["texts"])
    calibration = CalibrationSettings(**{**SYNC_DEFAULTS, **given})
    check_sync_calibration(calibration)
    return ConversionRequest(
        model=body.model, recipe=body.recipe_json() or {"backend": body.backend}, calibration=calibration,
        include=tuple(body.include),
        exclude=tuple(body.exclude), skip_first_last=body.skip_first_last,
        convert_router_gates=body.convert_router_gates, min_sqnr_db=body.min_sqnr_db,
        compare_recipes=tuple(body.compare_recipes or ()))


def _analysis_report(sources: Any, options: dict[str, Any], request: Any) -> dict[str, Any]:
    """``converters.pipeline.sync_analysis.analysis_report``, run in an analysis process (see :func:`analyze`)."""
    from converters.pipeline.sync_analysis import analysis_report  # imports torch: only in an analysis process

    return analysis_report(sources, options, request)
