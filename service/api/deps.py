"""FastAPI dependencies, declared once as ``Annotated`` aliases."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Annotated, TypeVar

from fastapi import Depends, Path, Request
from fastapi.concurrency import run_in_threadpool

from service.api.auth import CallerDep
from service.artifacts import ArtifactStorage
from service.config import Settings
from service.errors import JobNotFound
from service.jobs import Job
from service.store import JobStore

__all__ = ["SettingsDep", "StoreDep", "StorageDep", "JobDep", "read_store"]

T = TypeVar("T")


# Coroutines, though they only read app.state: FastAPI runs a plain ``def`` dependency in the threadpool, and a
# status poll paid such a hop for each of them.
async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_store(request: Request) -> JobStore:
    return request.app.state.store


async def get_storage(request: Request) -> ArtifactStorage:
    return request.app.state.storage


SettingsDep = Annotated[Settings, Depends(get_settings)]
StoreDep = Annotated[JobStore, Depends(get_store)]
StorageDep = Annotated[ArtifactStorage, Depends(get_storage)]


async def read_store(store: JobStore, read: Callable[[], T]) -> T:
    """Run a short read of ``store``: on the event loop for a SQLite file (``JobStore.reads_inline``: microseconds
    from the page cache, and WAL never makes a reader wait), in the threadpool for a database server."""
    return read() if store.reads_inline else await run_in_threadpool(read)


async def get_job(job_id: Annotated[str, Path(max_length=64)], request: Request, caller: CallerDep) -> Job:
    """The job named in the path, if the caller may see it; JobNotFound (404) otherwise.

    Someone else's job answers exactly like a missing one, so job ids cannot be probed. The store is read from
    the app directly rather than through StoreDep: on a status poll every resolved dependency costs. A SQLite
    store is read on the event loop (``JobStore.reads_inline``): a threadpool hop per poll costs more than the
    read (measured by benchmarks/bench_api.py --parts idle).
    """
    store: JobStore = request.app.state.store
    job = await read_store(store, partial(store.get_job, job_id))
    if not caller.may_see(job):
        raise JobNotFound(f"no job with id {job_id!r}")
    return job


JobDep = Annotated[Job, Depends(get_job)]
