"""``FP8FORGE_EXECUTOR=slurm``: the service submits its jobs to Slurm instead of running local workers.

One thread in ``fp8forge serve`` (in place of the local worker pool) looks at the store and at ``squeue`` every
``poll_interval_s``:

- a queued job without an allocation is submitted, with the ``slurm_*`` settings or the request's own ``slurm``
  values (:mod:`service.executors.slurm_options`): a calibrated job as one batch job whose ranks ``srun`` starts
  (``service.executors.slurm_rank``), a requantize job, once split into its tasks here, as a Slurm array whose
  tasks claim them; an ``executor`` event names the Slurm job;
- a running requantize job whose array has ended with work left (its time limit) gets a new array;
- a job cancelled through the API (or failed, or deleted) whose Slurm job is still there is ``scancel``-ed; a
  cancelling one once its ranks had ``cancel_grace_s`` to stop it themselves;
- the reapers of the local workers run here: an attempt whose ranks went silent (a node lost, a kill -9) is
  requeued, and submitted again.

A calibrated job whose allocation reaches its time limit gets SIGTERM in its ranks, which requeue it as a local
worker does when it is stopped (no attempt used up); it is then submitted again. A Slurm job that ends without ever
claiming its job (the node could not start Python, the settings file was unreadable) is retried
``_FAILED_STARTS`` times, then the job fails naming Slurm's output file.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

from sqlalchemy.exc import DBAPIError

from service.artifacts import ArtifactStorage, open_storage
from service.config import Settings, make_private_dir
from service.errors import InvalidTransition, JobNotFound
from service.executors.slurm_cli import SlurmCli, SlurmError, SlurmJob, SlurmResources, array_script, calibrated_script
from service.executors.slurm_options import job_resources
from service.jobs import Job, JobStatus
from service.store import JobStore
from service.store.workers import WorkerRegistry
from service.workers.reaper import reap_stale
from service.workers.split_jobs import fail_job, is_split_job, reap_stale_tasks, split_job

__all__ = ["SlurmDispatcher", "EXECUTOR_EVENT"]

logger = logging.getLogger(__name__)

#: The kind of the events that name the Slurm job a job's attempt runs in.
EXECUTOR_EVENT = "executor"
_FAILED_STARTS = 3
_FINISHED = (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class SlurmDispatcher:
    """Submits the store's jobs to Slurm and ends the Slurm jobs of jobs that ended; same life cycle as
    ``service.workers.pool.WorkerPool`` (start, begin_stop, stop)."""

    def __init__(self, settings: Settings, *, cli: SlurmCli | None = None, store: JobStore | None = None,
                 storage: ArtifactStorage | None = None) -> None:
        self.settings = settings
        self.cli = cli or SlurmCli()
        self.store = store or JobStore.from_settings(settings)
        self.dirs = storage or open_storage(settings)
        self.resources = SlurmResources.from_settings(settings)
        self.python = settings.slurm_python or sys.executable
        # it heartbeats as a worker without a host: /readyz counts it, claims' host-fault rules ignore it
        self.worker_id = f"{WorkerRegistry.new_id()}:slurm-dispatch"
        self._cancelling_since: dict[str, float] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="fp8forge-slurm-dispatch", daemon=True)

    @property
    def pids(self) -> list[int]:
        return []  # its work runs in Slurm's processes, on Slurm's nodes

    def start(self) -> None:
        self.dirs.ensure()
        make_private_dir(self.settings.slurm_dir)
        self._thread.start()
        logger.info("jobs run on Slurm (%s)", self.resources)

    def begin_stop(self) -> None:
        self._stopping.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop dispatching; the Slurm jobs already submitted go on (their ranks report to the store)."""
        self.begin_stop()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        try:
            self.store.workers.remove(self.worker_id)
        except DBAPIError:
            logger.warning("could not remove the dispatcher from the store", exc_info=True)

    def _loop(self) -> None:
        while not self._stopping.is_set():
            try:
                self.run_once()
            except (SlurmError, DBAPIError) as exc:  # a controller or store away for a while: try again later
                logger.warning("slurm dispatch: %s; retrying", exc)
            except Exception:  # noqa: BLE001 - one bad job must not stop the dispatching of every other one
                logger.exception("slurm dispatch error; going on")
            self._stopping.wait(self.settings.poll_interval_s)

    def run_once(self) -> None:
        """One look at the store and at Slurm: reap, submit, resubmit, cancel."""
        self.store.workers.heartbeat(self.worker_id)
        reap_stale(self.store, self.dirs, self.settings.heartbeat_timeout_s)
        reap_stale_tasks(self.store, self.dirs, self.settings.heartbeat_timeout_s)
        allocated: dict[str, list[SlurmJob]] = {}
        for slurm_job in self.cli.jobs():
            allocated.setdefault(slurm_job.job_id, []).append(slurm_job)
        submitted = set()  # in this pass: squeue's answer above predates them
        for job in self._jobs(JobStatus.QUEUED):
            if job.id not in allocated:
                self._submit(job)
                submitted.add(job.id)
        for job in self._jobs(JobStatus.RUNNING):
            if job.id not in allocated and job.id not in submitted and self.store.tasks.is_split(job.id):
                self._submit_array(job, again=True)  # its array ended (time limit) with tasks left
        for job_id, slurm_jobs in allocated.items():
            self._end_if_over(job_id, slurm_jobs)
        self._drop_resume_records(allocated)

    def _drop_resume_records(self, allocated: dict[str, list[SlurmJob]]) -> None:
        """Remove the per-layer resume record of each job that ended without publishing (a publish removes its
        own): cancelled, failed or deleted, with no Slurm job of it left. Slurm's output files stay."""
        for record in self.settings.slurm_dir.glob("*/resume"):
            job_id = record.parent.name
            if job_id in allocated:
                continue
            try:
                if not self.store.get_job(job_id).status.is_finished:
                    continue
            except JobNotFound:
                pass
            shutil.rmtree(record, ignore_errors=True)
            logger.info("job %s: its resume record is removed", job_id)

    def _jobs(self, status: JobStatus) -> list[Job]:
        """Every job with ``status``, oldest first."""
        found, cursor = [], None
        while True:
            page, cursor = self.store.list_jobs(status=status, limit=200, cursor=cursor)
            found += page
            if cursor is None:
                return found[::-1]

    # -- submitting --------------------------------------------------------------------------------
    def _submit(self, job: Job) -> None:
        if self._gave_up(job):
            return
        if is_split_job(job.request):
            claimed = self.store.claim_next(self.worker_id, job_id=job.id)
            if claimed is None or not split_job(self.store, self.dirs, self.worker_id, claimed,
                                                self.settings.max_attempts):
                return  # cancelled meanwhile
            self._submit_array(claimed)
            return
        output_dir = self._job_dir(job.id)
        script = calibrated_script(job.id, job_resources(self.resources, job.request, self.settings),
                                   python=self.python, settings_file=self._settings_file(), output_dir=output_dir)
        slurm_id = self.cli.submit(script)
        self._record(job, slurm_id, f"slurm-{slurm_id}.out", "batch job")

    def _submit_array(self, job: Job, *, again: bool = False) -> None:
        if again and self._gave_up(job):
            return
        output_dir = self._job_dir(job.id)
        resources = job_resources(self.resources, job.request, self.settings)
        script = array_script(job.id, resources, python=self.python, settings_file=self._settings_file(),
                              output_dir=output_dir)
        slurm_id = self.cli.submit(script)
        self._record(job, slurm_id, f"slurm-{slurm_id}_*.out", f"array of {resources.array_tasks} tasks")

    def _gave_up(self, job: Job) -> bool:
        """Fail the job when its last ``_FAILED_STARTS`` Slurm jobs all ended without it moving on (no claim, no
        stage, no progress): their nodes cannot run it, and another submission would do the same."""
        streak, output, after = 0, "", 0
        while events := self.store.events.after(job.id, after, limit=1000):
            for event in events:
                if event.kind == EXECUTOR_EVENT:
                    streak, output = streak + 1, event.data.get("output", "")
                elif event.kind in ("stage", "progress") or event.data.get("status") == JobStatus.RUNNING.value:
                    streak = 0
            after = events[-1].seq
        if streak < _FAILED_STARTS:
            return False
        # the file's name only: clients never learn the server's directories (its full path goes to the log)
        message = (f"{streak} Slurm jobs in a row ended without this job moving on; Slurm's output ({output} in "
                   f"FP8FORGE_SLURM_WORK_DIR/{job.id}/ on the service host) says why: a node without the fp8forge "
                   "install at FP8FORGE_SLURM_PYTHON, or without FP8FORGE_SLURM_WORK_DIR mounted, or a time limit "
                   "too short for one step")
        logger.error("job %s: %s (%s)", job.id, message, self.settings.slurm_dir / job.id / output)
        if job.status is JobStatus.RUNNING:
            fail_job(self.store, self.dirs, job.id, "executor_failed", message)
            return True
        claimed = self.store.claim_next(self.worker_id, job_id=job.id)  # a queued job cannot fail but by its owner
        if claimed is not None:
            try:
                self.store.set_status(job.id, JobStatus.FAILED, owner=self.worker_id, error_code="executor_failed",
                                      error_message=message,
                                      event={"error": {"code": "executor_failed", "message": message}})
            except InvalidTransition:  # cancelled meanwhile
                pass
        return True

    def _record(self, job: Job, slurm_id: str, output: str, what: str) -> None:
        logger.info("job %s: submitted to Slurm as %s %s", job.id, what, slurm_id)
        self.store.events.add(job.id, EXECUTOR_EVENT, {
            "engine": "slurm", "slurm_job": slurm_id, "message": f"submitted to Slurm as {what} {slurm_id}",
            "output": output})  # a name in the job's directory of FP8FORGE_SLURM_WORK_DIR

    def _job_dir(self, job_id: str) -> Path:
        """Where Slurm writes the job's output files: Slurm does not create the directory itself."""
        return make_private_dir(self.settings.slurm_dir / job_id)

    def _settings_file(self) -> Path:
        """The settings the ranks read (the store's URL, the artifact store's): readable by this user alone."""
        path = self.settings.slurm_dir / "settings.json"
        text = self.settings.model_dump_json()
        if not path.exists() or path.read_text() != text:
            partial = path.with_name(f".settings.{os.getpid()}.json")
            fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(partial, path)
        return path

    # -- ending ------------------------------------------------------------------------------------
    def _end_if_over(self, job_id: str, slurm_jobs: list[SlurmJob]) -> None:
        try:
            status = self.store.get_job(job_id).status
        except JobNotFound:
            status = None  # deleted: nobody waits for its result
        if status is JobStatus.CANCELLING:
            # the ranks see the cancel at their next heartbeat and stop the run themselves, recording it; a rank
            # stuck past the grace gets Slurm's signal
            since = self._cancelling_since.setdefault(job_id, time.monotonic())
            if time.monotonic() - since < self.settings.cancel_grace_s + 2 * self.settings.heartbeat_interval_s:
                return
        elif status is not None and status not in _FINISHED:
            return
        elif status is JobStatus.SUCCEEDED and all(s.state != "PENDING" for s in slurm_jobs):
            return  # its ranks are on their way out; only array tasks that never started are ended
        self._cancelling_since.pop(job_id, None)
        for slurm_job in slurm_jobs:
            logger.info("job %s: %s; scancel of Slurm job %s", job_id, status.value if status else "deleted",
                        slurm_job.slurm_id)
            self.cli.cancel(slurm_job.slurm_id)
