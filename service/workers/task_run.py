"""Runs one claimed task of a split job (or a calibrated job's serving shard): start the task child (a fork of the
worker's task server, ``service.workers.task_server``), heartbeat, honour cancel, record the result.

The task is heartbeaten from a thread of its own from the claim until its outcome is recorded, so nothing the run
does meanwhile (the task server's first start, receiving and storing a large result, an upload, publishing) leaves
it silent; the supervision loop only reads what the heartbeats found (a cancel, the task taken away).

Every task of a job writes into the job attempt's directory on its worker's host (``attempt_dir``): on a shared
disk that is the one directory the finish task publishes by renaming it; with the object store each write task
uploads its shard under the attempt's prefix and drops its local copy, and the finish task uploads its own files,
then publishes inside the transaction that records the job's success, checking the prefix holds exactly the
listed files. Nothing is published before the finish. A task that crashes or whose worker dies is retried on its
own (``max_attempts`` each); a task that fails on bad input fails the job at once, naming its shard. A task whose
worker's disk filled up (``disk_full``) or whose worker was lost is retried on another host, without using up an
attempt (``service.store.host_faults``).

A calibrated job's ``serving_write`` task writes into that job attempt's staging directory, where its conversion
(still running in its own worker: ``service.workers.serving_shards``) reads it; the conversion records the outcome.
What a kind reads, where it writes and what its success does are its entry in ``service.workers.task_kinds``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from sqlalchemy.exc import DBAPIError

from converters.artifact.layout import staging_dir_for
from converters.errors import ConversionError
from service.artifacts import ArtifactStorage, ArtifactUploadFailed
from service.config import Settings
from service.errors import InvalidTransition
from service.jobs import Job, JobStatus, Task, TaskStatus
from service.store import JobStore
from service.store.schema import brief
from service.store.tasks import HostFaultRetry
from service.workers.messages import DISK_FULL, Failed, TaskDone
from service.workers.runner import ensure_dead
from service.workers.split_jobs import fail_job, settle
from service.workers.task_child import task_child_main
from service.workers.task_kinds import Outcome, OutputDir, ShardTask, task_kind
from service.workers.task_results import loaded_result, stored_result
from service.workers.task_server import task_context

__all__ = ["TaskRun"]

logger = logging.getLogger(__name__)


class TaskRun:
    """One attempt of one task on this worker."""

    def __init__(self, settings: Settings, store: JobStore, dirs: ArtifactStorage, worker_id: str, task: Task,
                 stopping: threading.Event, *, log_level: str | None = None) -> None:
        self.settings, self.store, self.dirs, self.worker_id, self.task = settings, store, dirs, worker_id, task
        self.stopping, self.log_level = stopping, log_level
        self._failing_since: float | None = None
        #: The job's status as the last heartbeat found it; None once the task is not this worker's any more.
        self._status: JobStatus | None = JobStatus.RUNNING

    def execute(self) -> TaskStatus | None:
        """Run the attempt to its end; returns the task's recorded status (None when it was taken away)."""
        with self._beating():
            return self._execute()

    def _execute(self) -> TaskStatus | None:
        task = self.task
        job = self.store.get_job(task.job_id)
        try:
            kind = task_kind(task.kind)
        except ConversionError as exc:  # a row of another release: say so instead of running it as something else
            return self._fail(job, exc.code, exc.message)
        if task.queued_by_attempt not in (None, job.attempt):  # that attempt has ended: nobody waits for the task
            self.store.tasks.release(task, TaskStatus.CANCELLED, worker_id=self.worker_id)
            return TaskStatus.CANCELLED
        out_dir = self.dirs.attempt_dir(job.id, job.attempt)
        if kind.output is OutputDir.STAGING:
            # the conversion's own staging directory, which it made: written where it reads (a shared disk)
            out_dir = staging_dir_for(out_dir)
        else:
            out_dir.mkdir(parents=True, exist_ok=True)
        ctx = task_context(conversions=False)
        receiver, sender = ctx.Pipe(duplex=False)
        options = {"threads": self.settings.conversion_threads, "log_level": self.log_level}
        proc = ctx.Process(
            target=task_child_main, name=f"fp8forge-task-{task.seq}",
            args=(ShardTask.of(task).to_dict(), task.source, self._inputs(), str(out_dir),
                  self.settings.model_sources(), sender, os.getpid()),
            kwargs={name: value for name, value in options.items() if value is not None})
        proc.start()  # the worker's first task waits for its task server's imports; the heartbeats go on
        sender.close()
        logger.info("job %s: %s started (%s, attempt %d of %d)", job.id, task.name, task.kind, task.attempt,
                    task.max_attempts)
        ended, result = "crashed", None
        try:
            ended, result = self._supervise(proc, receiver)
        finally:
            if ended == "result":
                proc.kill()  # it sent its result; nothing it does after that matters
            ensure_dead(proc)
            receiver.close()
        return self._record(job, ended, result, proc.exitcode)

    def _inputs(self) -> dict[str, Any]:
        """What the task reads of earlier tasks of its job (its kind's ``reads``), results kept in files loaded."""
        job_id, kind = self.task.job_id, task_kind(self.task.kind)
        if kind.reads is None:
            return {}
        return kind.reads(lambda name: [loaded_result(self.dirs, job_id, result)
                                        for result in self.store.tasks.results(job_id, name)])

    # -- supervision -------------------------------------------------------------------------------
    def _supervise(self, proc: BaseProcess, receiver: Connection) -> tuple[str, Any]:
        """Until the child ends or must stop: ("result", message), ("crashed", None), ("lost", None),
        ("stopped", the job's status) or ("shutdown", None)."""
        while True:
            try:
                if receiver.poll(0.2):
                    message = receiver.recv()
                    if isinstance(message, (TaskDone, Failed)):
                        # the child's work is done: its teardown (torch's) is not waited for
                        return "result", message
            except (EOFError, OSError):
                if not proc.is_alive():
                    return "crashed", None
            status = self._status
            if status is None:
                return "lost", None
            if status is not JobStatus.RUNNING:
                return "stopped", status
            if self.stopping.is_set():
                return "shutdown", None
            if not proc.is_alive() and not receiver.poll():
                return "crashed", None

    def _heartbeat(self) -> JobStatus | None:
        """The job's status; None once the task is not this worker's (or the store was silent too long)."""
        try:
            status = self.store.tasks.heartbeat(self.task, self.worker_id)
        except DBAPIError as exc:
            now = time.monotonic()
            if self._failing_since is None:
                self._failing_since = now
                logger.warning("job %s: the job store does not answer (%s); the task goes on meanwhile",
                               self.task.job_id, brief(exc))
            return JobStatus.RUNNING if now - self._failing_since < self.settings.heartbeat_timeout_s else None
        self._failing_since = None
        return status

    @contextlib.contextmanager
    def _beating(self) -> Iterator[None]:
        """Heartbeat the task from a thread of its own, as often as a cancel should be noticed, until the block
        ends (it ends at once when the task is no longer this worker's)."""
        done = threading.Event()
        every = min(self.settings.heartbeat_interval_s, 0.5)

        def beat() -> None:
            while not done.wait(every):
                self._status = self._heartbeat()
                if self._status is None:
                    return

        thread = threading.Thread(target=beat, name=f"fp8forge-task-{self.task.seq}-beat", daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()

    # -- outcome -----------------------------------------------------------------------------------
    def _record(self, job: Job, ended: str, result: Any, exitcode: int | None) -> TaskStatus | None:
        task = self.task
        if ended == "lost":
            logger.warning("job %s: %s was taken from this worker; its result is discarded", job.id, task.name)
            return None
        if ended == "stopped":
            self.store.tasks.release(task, TaskStatus.CANCELLED, worker_id=self.worker_id)
            settle(self.store, self.dirs, job.id)
            return TaskStatus.CANCELLED
        if ended == "shutdown":  # the worker is stopping: another runs the task, without using up an attempt
            released = self.store.tasks.release(task, TaskStatus.QUEUED, worker_id=self.worker_id, count_attempt=False)
            return TaskStatus.QUEUED if released else None
        if isinstance(result, TaskDone):
            try:
                return self._succeed(job, result.result)
            except ArtifactUploadFailed as exc:
                logger.error("job %s: %s: %s", job.id, task.name, exc, exc_info=exc.__cause__)
                return self._retry_or_fail("artifact_upload_failed", str(exc))
        if isinstance(result, Failed) and result.code != DISK_FULL:
            return self._fail(job, result.code, result.message)
        if isinstance(result, Failed):
            return self._host_fault(DISK_FULL, result.message)
        return self._retry_or_fail("worker_crashed", f"the task process exited with code {exitcode} without a result")

    def _fail(self, job: Job, code: str, message: str) -> TaskStatus:
        """Fail the task and its job at once (bad input: another attempt would fail so too)."""
        task = self.task
        self.store.tasks.release(task, TaskStatus.FAILED, worker_id=self.worker_id, error=(code, message))
        if code == "internal_error":  # the raw text stays in the log (it names files and internals)
            logger.error("job %s: %s failed with an internal error: %s", job.id, task.name, message)
            message = f"the task failed with an unexpected internal error; the worker's log has the details " \
                      f"(job {job.id})"
        fail_job(self.store, self.dirs, job.id, code, f"{task.name}: {message}")
        return TaskStatus.FAILED

    def _host_fault(self, code: str, message: str) -> TaskStatus | None:
        """Requeue the task for a worker on another host, charging this one with the fault; once the task has had
        its host-fault retries (or this host is unknown) the fault uses up an attempt like any other."""
        task = self.task
        where = f"{message} (attempt {task.attempt} of {task.max_attempts})"
        retry, hosts = self.store.tasks.release_host_fault(task, worker_id=self.worker_id, error=(code, where))
        if retry is HostFaultRetry.SPENT:
            return self._retry_or_fail(code, message)
        if retry is HostFaultRetry.CHANGED:
            return None
        logger.warning("job %s: %s: %s; it runs again on another host", task.job_id, task.name, where)
        self.store.events.add(task.job_id, "warning", {
            "message": f"{task.name}: {where}; it runs again on another host, without using up an attempt",
            "reason": code, "shard": task.shard, **hosts})
        return TaskStatus.QUEUED

    def _retry_or_fail(self, code: str, message: str) -> TaskStatus | None:
        task = self.task
        where = f"{message} (attempt {task.attempt} of {task.max_attempts})"
        if task.attempt < task.max_attempts:
            if not self.store.tasks.release(task, TaskStatus.QUEUED, worker_id=self.worker_id, error=(code, where)):
                return None
            self.store.events.add(task.job_id, "warning", {"message": f"{task.name}: {where}; it runs again",
                                                           "reason": code, "shard": task.shard})
            return TaskStatus.QUEUED
        if not self.store.tasks.release(task, TaskStatus.FAILED, worker_id=self.worker_id, error=(code, where)):
            return None
        fail_job(self.store, self.dirs, task.job_id, code, f"{task.name}: {where}")
        return TaskStatus.FAILED

    def _succeed(self, job: Job, result: dict[str, Any]) -> TaskStatus | None:
        task, kind, new_tasks = self.task, task_kind(self.task.kind), ()
        if kind.outcome is Outcome.ADDS_TASKS:
            # a report too large for its row goes to a file in the attempt's scratch area (task_results)
            new_tasks = result["tasks"]
            result = stored_result(self.dirs, job.id, job.attempt, task.seq, {"report": result["report"]})
        elif kind.outcome is Outcome.UPLOADS_FILE and self.dirs.remote:
            self.dirs.upload(job.id, job.attempt, [result["file"]])
            (self.dirs.attempt_dir(job.id, job.attempt) / result["file"]["name"]).unlink(missing_ok=True)
        elif kind.outcome is Outcome.PUBLISHES:
            return self._publish(job, result["manifest"])
        if not self.store.tasks.succeed(task, self.worker_id, result, new_tasks=new_tasks):
            logger.warning("job %s: %s was taken from this worker before its result was recorded", job.id, task.name)
            return None
        logger.info("job %s: %s done", job.id, task.name)
        return TaskStatus.SUCCEEDED

    def _publish(self, job: Job, manifest: list[dict[str, Any]]) -> TaskStatus | None:
        """Upload the finish's files (object store), then record the job's success, publishing inside it."""
        shards = [write["file"] for write in self.store.tasks.results(job.id, "write")]
        listed = self.dirs.index(job.id, manifest, attempt=job.attempt)
        if self.dirs.remote:  # the shards are in the store already, from their writers
            names = {entry["name"] for entry in shards}
            local = [entry for entry in listed if entry["name"] not in names]
            self.dirs.upload(job.id, job.attempt, local)
            self.dirs.abort_uploads(job.id, job.attempt)  # what a killed shard writer left half sent
            listed = sorted([*local, *shards], key=lambda entry: entry["name"])
        def publish(conn: Any) -> None:  # the job's row locked: the files move in place, the finish task succeeds
            self.dirs.publish(job.id, job.attempt, listed)
            self.store.tasks.succeed_in(conn, self.task, self.worker_id, {"files": len(listed)})

        try:
            self.store.set_status(job.id, JobStatus.SUCCEEDED, artifacts=listed, event={"shards": len(shards)},
                                  before_commit=publish)
        except InvalidTransition:  # cancelled (or failed by another task) meanwhile
            self.store.tasks.release(self.task, TaskStatus.CANCELLED, worker_id=self.worker_id)
            settle(self.store, self.dirs, job.id)
            return TaskStatus.CANCELLED
        self.dirs.settle(job.id, job.attempt)
        logger.info("job %s: published %d files from %d shard tasks", job.id, len(listed), len(shards))
        return TaskStatus.SUCCEEDED
