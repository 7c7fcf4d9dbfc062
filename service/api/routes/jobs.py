"""/v1/jobs: submit, list, get, cancel, delete, follow events, list a job's tasks."""

from __future__ import annotations

import time
from functools import partial
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse

from service.api import operations
from service.api.auth import CallerDep
from service.api.deps import JobDep, SettingsDep, StorageDep, StoreDep, read_store
from service.api.events import LastEventIdHeader, event_stream_response
from service.api.limits import stream_slots
from service.api.routes import error_responses
from service.api.routes.analyze import ModelChecksDep
from service.api.schemas import JobCreate, JobPublic, JobsPublic, TaskPublic, TasksPublic
from service.jobs import JobStatus

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])


@router.post("", status_code=202, operation_id="createJob",
             responses=error_responses(400, 409, 413, 422, 429, 503))
async def create_job(
    body: JobCreate, store: StoreDep, settings: SettingsDep, caller: CallerDep, checks: ModelChecksDep,
    idempotency_key: Annotated[str, Header(alias="Idempotency-Key", max_length=200, pattern=r"^[ -~]*$",
                                           description="Printable ASCII; same key and body, same job.")] = None,
) -> JobPublic:
    """Queue a conversion job. The same Idempotency-Key with the same body returns the same job.

    A key with as many queued jobs as it may have gets 429 with ``Retry-After``. A local model's files (config,
    index, headers) are checked in the server's check processes: 503 when they are all busy.
    """
    job = await operations.submit_job(store, settings, body, idempotency_key, caller, checks)
    return JobPublic.from_job(job, caller)


@router.get("", operation_id="listJobs", response_model=JobsPublic, responses=error_responses(422))
async def list_jobs(
    store: StoreDep, caller: CallerDep, status: Annotated[JobStatus, Query()] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str, Query(pattern=r"^[0-9]{1,18}$", description="next_cursor of the page before")] = None,
) -> Response:
    """Your jobs (an admin's: everyone's), newest first; pass ``next_cursor`` back as ``cursor`` for more."""
    owner = None if caller.admin else caller.name
    jobs, next_cursor = await read_store(
        store, partial(store.list_jobs, status=status, limit=limit, cursor=cursor, owner=owner))
    # the body the model built is sent as it is, as for a status poll
    page = JobsPublic(data=[JobPublic.from_job(j, caller) for j in jobs], count=len(jobs), next_cursor=next_cursor)
    return Response(page.model_dump_json(), media_type="application/json")


@router.get("/{job_id}", operation_id="getJob", response_model=JobPublic, responses=error_responses(404, 422))
async def get_job(job: JobDep, caller: CallerDep) -> Response:
    # async: the one threadpool hop of a status poll is JobDep's database read (a sync route adds two more: one
    # to run it, one to validate its response). The body is built by the model and sent as it is: FastAPI
    # would otherwise validate and serialise the model a second time on every poll.
    return Response(JobPublic.from_job(job, caller).model_dump_json(), media_type="application/json")


@router.post("/{job_id}/cancel", status_code=202, operation_id="cancelJob", responses=error_responses(404, 409, 422))
def cancel_job(job: JobDep, store: StoreDep, caller: CallerDep) -> JobPublic:
    """Cancel a queued or running job (409 once it has finished)."""
    return JobPublic.from_job(operations.cancel_job(store, job.id), caller)


@router.delete("/{job_id}", status_code=204, operation_id="deleteJob", responses=error_responses(404, 409, 422))
def delete_job(job: JobDep, store: StoreDep, storage: StorageDep) -> Response:
    """Delete a finished job and its artifacts (409 while it is queued or running)."""
    operations.delete_job(store, storage, job.id)
    return Response(status_code=204)


@router.get(
    "/{job_id}/events", operation_id="streamJobEvents", response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "Server-sent events."},
               **error_responses(404, 422, 429)},
)
async def stream_job_events(
    job: JobDep, store: StoreDep, caller: CallerDep, request: Request,
    last_event_id: LastEventIdHeader = None,
) -> StreamingResponse:
    """The job's event log (status, stage, progress, warning) as SSE; ends when the job has finished.

    A key with as many streams open as it may gets 429 with ``Retry-After``; a stream counts until it ends.
    """
    release = stream_slots(request.app).acquire(caller.name)
    return event_stream_response(store, job.id, last_event_id or 0, release)


@router.get("/{job_id}/tasks", operation_id="listJobTasks", response_model=TasksPublic,
            responses=error_responses(404, 422))
async def list_job_tasks(job: JobDep, store: StoreDep, caller: CallerDep) -> Response:
    """The job's tasks, in the order they were queued: which worker (and, for admins, which host) ran each shard,
    its attempt, state, times and error. Empty for a job that is not split into tasks (a calibrated job without
    a sharded serving export) and for one not started yet."""
    rows = await read_store(store, partial(store.tasks.listing, job.id))
    now = time.time()
    data = [TaskPublic.from_row(row, caller, now) for row in rows]
    return Response(TasksPublic(data=data, count=len(data)).model_dump_json(), media_type="application/json")
