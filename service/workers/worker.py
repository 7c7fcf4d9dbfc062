"""The worker loop: stop check -> reap stale jobs and tasks (and now and then sweep orphaned attempt files) ->
claim a task of a split job, else a job -> run in a child process -> record (a job's child and a task's are forks
of the worker's fork server: ``service.workers.task_server``).

A requantize job is split into tasks (``service.workers.split_jobs``) that any worker claims one at a time, a
task before a new job, so the jobs already started move on; every other job runs whole in one worker.

One job at a time per worker; run one worker per GPU. ``worker_process_main`` is the entry point of a
worker process (``fp8forge worker`` and the processes ``fp8forge serve`` starts). With the object store, a
worker's own disk holds only the model cache, demo models and the attempt it is writing.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

from sqlalchemy.exc import DBAPIError

from service.artifacts import ArtifactStorage, open_storage
from service.config import Settings
from service.store import JobStore
from service.store.schema import brief, lock_refused
from service.store.tasks import this_host
from service.store.workers import WorkerRegistry
from service.workers.procs import configure_logging, die_with_parent
from service.workers.reaper import reap_stale, sweep_orphans
from service.workers.runner import JobRun
from service.workers.split_jobs import is_split_job, reap_stale_tasks, split_job
from service.workers.task_run import TaskRun
from service.workers.task_server import start_task_server

__all__ = ["Worker", "worker_process_main"]

logger = logging.getLogger(__name__)


class Worker:
    """Claims and runs jobs until :meth:`stop` is called.

    Args:
        settings: service settings (store URL, data dir, artifact storage, heartbeat and retry knobs).
        store: an open store; one is opened from ``settings`` when omitted.
        storage: the artifact storage; the one the settings name when omitted.
        log_level: the level its conversion children log fp8forge's own records at (theirs when omitted: INFO).
    """

    def __init__(
        self, settings: Settings, store: JobStore | None = None, storage: ArtifactStorage | None = None, *,
        log_level: str | None = None,
    ) -> None:
        self.settings = settings
        self.store = store or JobStore.from_settings(settings)
        self.dirs = storage or open_storage(settings)
        self.log_level = log_level
        self.worker_id = WorkerRegistry.new_id()
        self.host = this_host(settings.data_dir)
        self.stopping = threading.Event()
        self._job_id: str | None = None  # what the heartbeat thread reports this worker runs

    def stop(self) -> None:
        """Ask the loop to end; a running job is stopped and requeued without using up an attempt."""
        self.stopping.set()

    def run(self) -> None:
        self.dirs.ensure()
        logger.info("worker %s started", self.worker_id)
        next_reap = next_sweep = 0.0  # the first sweep finds what a killed predecessor left on this host
        beating = threading.Event()
        beat = threading.Thread(target=self._beat, args=(beating,), name="fp8forge-worker-beat", daemon=True)
        beat.start()
        try:
            while not self.stopping.is_set():
                try:
                    if time.monotonic() >= next_reap:
                        reap_stale(self.store, self.dirs, self.settings.heartbeat_timeout_s)
                        reap_stale_tasks(self.store, self.dirs, self.settings.heartbeat_timeout_s)
                        next_reap = time.monotonic() + self.settings.heartbeat_interval_s
                    if time.monotonic() >= next_sweep:
                        next_sweep = time.monotonic() + self.settings.artifact_sweep_interval_s
                        sweep_orphans(self.store, self.dirs)
                    if not self.run_once():
                        self.stopping.wait(self.settings.poll_interval_s)
                except DBAPIError as exc:
                    if lock_refused(exc):  # another process holds what this needed: not now
                        logger.warning("the job store is busy (%s); retrying", brief(exc))
                    else:
                        logger.exception("job store error; retrying")
                    self.stopping.wait(self.settings.poll_interval_s)
                except Exception:  # noqa: BLE001 - one bad job or a file race must not end the worker for good
                    logger.exception("worker loop error; going on")
                    self.stopping.wait(self.settings.poll_interval_s)
        finally:
            beating.set()
            beat.join()
            try:
                self.store.workers.remove(self.worker_id)
            except DBAPIError:  # its row expires by itself (live_workers forgets silent workers)
                logger.warning("could not remove worker %s from the store", self.worker_id, exc_info=True)
            logger.info("worker %s stopped", self.worker_id)

    def _beat(self, done: threading.Event) -> None:
        """Heartbeat this worker's row from its own thread until ``done``, whatever the loop is busy with (a task's
        result being stored, a job's upload): claims count it live, so retries of another host's faults wait for
        it, and ``/readyz`` counts it."""
        while not done.wait(self.settings.heartbeat_interval_s):
            try:
                self.store.workers.heartbeat(self.worker_id, self._job_id, host=self.host)
            except DBAPIError as exc:  # the loop's own store calls report a store that stays away
                logger.debug("worker heartbeat failed (%s)", brief(exc))

    def run_once(self) -> bool:
        """Claim and run one task of a split job, else one job; False when nothing was ready."""
        live_within_s, self._job_id = self.settings.heartbeat_timeout_s, None
        self.store.workers.heartbeat(self.worker_id, host=self.host)
        task = self.store.tasks.claim(self.worker_id, self.host, live_within_s=live_within_s)
        if task is not None:
            self._job_id = task.job_id
            self.store.workers.heartbeat(self.worker_id, task.job_id, host=self.host)
            status = TaskRun(self.settings, self.store, self.dirs, self.worker_id, task, self.stopping,
                             log_level=self.log_level).execute()
            logger.info("job %s: %s: %s", task.job_id, task.name, status.value if status else "lost")
            self._job_id = None
            self.store.workers.heartbeat(self.worker_id, host=self.host)
            return True
        job = self.store.claim_next(self.worker_id, host=self.host, live_within_s=live_within_s,
                                    max_running_per_owner=self.settings.max_running_jobs_per_key)
        if job is None:
            return False
        if is_split_job(job.request):
            start_task_server(conversions=False)  # its imports run while the plan task is queued: the tasks follow
            split_job(self.store, self.dirs, self.worker_id, job, self.settings.max_attempts)
            return True
        logger.info("job %s: claimed, attempt %d of %d", job.id, job.attempt, job.max_attempts)
        self._job_id = job.id
        self.store.workers.heartbeat(self.worker_id, job.id, host=self.host)
        status = JobRun(self.settings, self.store, self.dirs, self.worker_id, job, self.stopping,
                        log_level=self.log_level).execute()
        logger.info("job %s: %s", job.id, status.value if status else "lost")
        self._job_id = None
        self.store.workers.heartbeat(self.worker_id, host=self.host)
        return True


def worker_process_main(
    settings: Settings, gpu: str | None = None, parent_pid: int | None = None, log_level: str = "info",
) -> None:
    """Run a worker in this process until SIGTERM/SIGINT (or until ``parent_pid`` dies).

    Its log, and its conversion children's, shows fp8forge's own records from ``log_level`` up.
    """
    if parent_pid is not None:
        die_with_parent(parent_pid, signal.SIGTERM)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before anything in this tree initialises CUDA
    configure_logging(log_level, "worker")
    worker = Worker(settings, log_level=log_level)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: worker.stop())
    try:
        worker.run()
    finally:
        worker.store.close()
