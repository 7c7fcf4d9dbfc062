"""Stale-job detection and the sweeper of orphaned attempt files.

A job whose worker stopped heartbeating is requeued, or failed after its last try; a lost worker is a fault of its
host, so the retry goes to another host without using up an attempt (``service.store.host_faults``). Attempt
files (local directories, object-store prefixes and unfinished uploads) that no job can still use are removed. Any
process may run both (workers between jobs, the API in the background); the store's compare-and-set makes
concurrent reapers harmless, and the sweeper only judges jobs that have finished or are gone, which no
worker writes to any more.
"""

from __future__ import annotations

import logging
import threading
import time

from service.artifacts import ArtifactStorage, Leftover
from service.errors import InvalidTransition, JobNotFound
from service.jobs import Job, JobStatus
from service.store import JobBusy, JobLost, JobStore
from service.workers.split_jobs import reap_stale_tasks

__all__ = ["reap_stale", "sweep_orphans", "Reaper"]

logger = logging.getLogger(__name__)


def reap_stale(store: JobStore, dirs: ArtifactStorage, timeout_s: float) -> list[tuple[str, JobStatus]]:
    """Requeue (or fail, or finish cancelling) every job silent for ``timeout_s``; returns what changed."""
    changed = []
    for job in store.find_stale(timeout_s):
        values: dict[str, object] = {}
        event: dict[str, object] = {"reason": "worker_lost"}
        fault = store.host_fault(job.id) if job.status is JobStatus.RUNNING else None
        if job.status is JobStatus.CANCELLING:
            target = JobStatus.CANCELLED
        elif fault is not None:
            target, values = JobStatus.QUEUED, {"worker_id": None, **fault.values}
            event.update(fault.event, message=f"its worker stopped heartbeating for {timeout_s:g}s on attempt "
                                              f"{job.attempt}; it runs again on another host, without using up an "
                                              "attempt")
        elif job.attempt < job.max_attempts:
            target, values = JobStatus.QUEUED, {"worker_id": None}
        else:
            target = JobStatus.FAILED
            values = {"error_code": "worker_lost", "error_message": (
                f"the worker stopped heartbeating for {timeout_s:g}s on attempt {job.attempt} of "
                f"{job.max_attempts}; giving up")}
        try:
            # judged again inside the write, by the database's clock: a heartbeat since find_stale keeps the job
            store.set_status(job.id, target, stale_for_s=timeout_s, event=event, **values)
        except (JobLost, InvalidTransition):
            continue
        except JobBusy:  # its row is held (its worker stopped inside a write): the next round tries again
            logger.debug("job %s: silent, but its row is locked by another transaction; not reaped now", job.id)
            continue
        logger.warning("job %s: worker %s went silent; now %s", job.id, job.worker_id, target.value)
        if target.is_finished:
            dirs.remove(job.id)  # its worker is known dead; a requeued job's leftovers go when it is retried
        changed.append((job.id, target))
    return changed


def sweep_orphans(store: JobStore, storage: ArtifactStorage) -> list[Leftover]:
    """Remove attempt files no job can use any more; returns what was removed.

    An attempt's files are orphaned once its job is gone (deleted), or finished without them being its
    published ones: a failed or cancelled job's, a succeeded job's other attempts, and any local copy. Running
    and queued jobs are left alone: their own worker, or the next attempt's, cleans up after them.
    """
    removed = []
    jobs: dict[str, Job | None] = {}
    for leftover in storage.leftovers():
        if leftover.job_id not in jobs:
            try:
                jobs[leftover.job_id] = store.get_job(leftover.job_id)
            except JobNotFound:
                jobs[leftover.job_id] = None
        job = jobs[leftover.job_id]
        if job is not None and not job.status.is_finished:
            continue
        if (job is not None and job.status is JobStatus.SUCCEEDED and leftover.publishable
                and job.attempt == leftover.attempt):
            continue  # the job's published files
        storage.discard(leftover)
        removed.append(leftover)
    if removed:
        logger.info("removed %d orphaned attempt(s): %s", len(removed),
                    ", ".join(f"{r.job_id} a{r.attempt}" for r in removed))
    return removed


class Reaper:
    """Runs :func:`reap_stale` every ``interval_s`` seconds, and :func:`sweep_orphans` every ``sweep_every_s``,
    in a daemon thread."""

    def __init__(
        self, store: JobStore, dirs: ArtifactStorage, timeout_s: float, interval_s: float, *,
        sweep_every_s: float = 300.0,
    ) -> None:
        self._args = (store, dirs, timeout_s)
        self._interval = interval_s
        self._sweep_every = sweep_every_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fp8forge-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        next_sweep = time.monotonic()
        while not self._stop.wait(self._interval):
            try:
                reap_stale(*self._args)
                reap_stale_tasks(*self._args)
                if time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self._sweep_every
                    sweep_orphans(*self._args[:2])
            except Exception:  # noqa: BLE001 - keep reaping after a transient database or object-store error
                logger.exception("stale-job check or orphan sweep failed")
