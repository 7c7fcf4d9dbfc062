"""Stale-job detection: a job whose worker stopped heartbeating is requeued, or failed after its last try.

Any process may run it (workers between jobs, the API in the background); the store's compare-and-set
makes concurrent reapers harmless.
"""

from __future__ import annotations

import logging
import threading

from service.artifacts import ArtifactDirs
from service.errors import InvalidTransition
from service.jobs import JobStatus
from service.store import JobLost, JobStore

__all__ = ["reap_stale", "Reaper"]

logger = logging.getLogger(__name__)


def reap_stale(store: JobStore, dirs: ArtifactDirs, timeout_s: float) -> list[tuple[str, JobStatus]]:
    """Requeue (or fail, or finish cancelling) every job silent for ``timeout_s``; returns what changed."""
    changed = []
    for job in store.find_stale(timeout_s):
        values: dict[str, object] = {}
        if job.status is JobStatus.CANCELLING:
            target = JobStatus.CANCELLED
        elif job.attempt < job.max_attempts:
            target, values = JobStatus.QUEUED, {"worker_id": None}
        else:
            target = JobStatus.FAILED
            values = {"error_code": "worker_lost", "error_message": (
                f"the worker stopped heartbeating for {timeout_s:g}s on attempt {job.attempt} of "
                f"{job.max_attempts}; giving up")}
        try:
            # judged again inside the write, by the database's clock: a heartbeat since find_stale keeps the job
            store.set_status(job.id, target, stale_for_s=timeout_s, event={"reason": "worker_lost"}, **values)
        except (JobLost, InvalidTransition):
            continue
        logger.warning("job %s: worker %s went silent; now %s", job.id, job.worker_id, target.value)
        if target.is_finished:
            dirs.remove(job.id)  # its worker is known dead; a requeued job's leftovers go when it is retried
        changed.append((job.id, target))
    return changed


class Reaper:
    """Runs :func:`reap_stale` every ``interval_s`` seconds in a daemon thread."""

    def __init__(self, store: JobStore, dirs: ArtifactDirs, timeout_s: float, interval_s: float) -> None:
        self._args = (store, dirs, timeout_s)
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fp8forge-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                reap_stale(*self._args)
            except Exception:  # noqa: BLE001 - keep reaping after a transient database error
                logger.exception("stale-job check failed")
