"""Runs one claimed job: start the conversion child, relay its reports, heartbeat, honour cancel, record.

The worker process is the parent; the child (``service.workers.child``) is a fork of the worker's fork server
(``service.workers.task_server``: a process that imported torch and the pipeline but never ran anything), so it
never inherits CUDA or lock state, starts without an interpreter's start and torch's import, and dies with its
worker. Each attempt writes into its own directory; only
this worker, while it still owns the attempt, renames it to the job's final directory, inside the transaction
that records the success. Every other outcome (failure, cancel, requeue, a lost job) removes the attempt's
directory. A database that stops answering for a while does not stop the run: heartbeats and events are
retried until ``heartbeat_timeout_s`` of continuous failures, after which the job counts as lost.

This module supervises the child; recording the outcome once it has exited is ``service.workers.outcome``,
and the messages the child sends are ``service.workers.messages``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from sqlalchemy.exc import DBAPIError

from converters.pipeline.progress import progress_event
from service.artifacts import ArtifactStorage
from service.config import Settings
from service.jobs import Job, JobStatus, Stage
from service.store import JobStore
from service.store.schema import brief, lock_refused
from service.workers.child import child_main
from service.workers.messages import ChildMessage, Failed, Progress, StageStarted, Succeeded, Warned
from service.workers.outcome import AttemptOutcome
from service.workers.shard_export import shard_export_options
from service.workers.task_server import task_context, worker_environment
from service.workers.watch import RunWatch

__all__ = ["JobRun", "ensure_dead"]

logger = logging.getLogger(__name__)

_PROGRESS_EVENT_EVERY_S = 1.0
_KILL_AFTER_TERM_S = 1.0


class JobRun:
    """One attempt of one job on this worker: supervises the child, then hands over to ``AttemptOutcome``."""

    def __init__(
        self, settings: Settings, store: JobStore, dirs: ArtifactStorage, worker_id: str, job: Job,
        stopping: threading.Event, *, log_level: str | None = None, resume_dir: Path | None = None,
    ) -> None:
        self.settings, self.store, self.dirs = settings, store, dirs
        self.worker_id, self.job, self.stopping = worker_id, job, stopping
        self.log_level = log_level
        # one per job, kept across attempts (the Slurm executor's): the conversion resumes at its first unfinished
        # layer (docs/distributed.md); None: no resume record
        self.resume_dir = resume_dir
        self.watch = RunWatch()
        self._check_every = min(settings.heartbeat_interval_s, 0.5)

    def execute(self) -> JobStatus | None:
        """Run the attempt to its end; returns the status recorded (None if the job was lost)."""
        job_id, attempt = self.job.id, self.job.attempt
        self.dirs.ensure()
        # Leftovers of this and earlier attempts (and a final dir whose success was never recorded): this worker
        # owns the job now, so nobody else may publish it; a newer attempt's directory is never touched.
        self.dirs.remove(job_id, below_attempt=attempt + 1)
        ctx = task_context(conversions=True)
        receiver, sender = ctx.Pipe(duplex=False)
        stop = ctx.Event()
        # Unset, the child works its budget out from the CPUs it may use (the worker's, which it inherits), and
        # logs at its own default level.
        options = {"threads": self.settings.conversion_threads, "log_level": self.log_level,
                   "environ": worker_environment(),
                   "shard_export": shard_export_options(self.settings, self.job, self.worker_id),
                   "resume_dir": str(self.resume_dir) if self.resume_dir else None}
        proc = ctx.Process(
            target=child_main, name=f"fp8forge-job-{job_id[:8]}",
            args=(dict(self.job.request), str(self.dirs.attempt_dir(job_id, attempt)),
                  self.settings.model_sources(), sender, stop, os.getpid()),
            kwargs={name: value for name, value in options.items() if value is not None},
        )
        self._start(proc)
        sender.close()
        try:
            self._supervise(proc, receiver, stop)
        finally:
            ensure_dead(proc)
            receiver.close()
        if self.watch.lost:
            logger.warning("job %s was taken from this worker (or its store stayed unreachable); its result is "
                           "discarded", job_id)
            self.dirs.remove_attempt(job_id, attempt)
            return None
        self._end_stage()  # the run is over; what remains is recording it
        outcome = AttemptOutcome(self.store, self.dirs, self.worker_id, self.job, self.watch,
                                 heartbeat_interval_s=self.settings.heartbeat_interval_s)
        return outcome.record(proc.exitcode, flush_events=self._flush_events)

    # -- supervision -------------------------------------------------------------------------------
    def _start(self, proc: BaseProcess) -> None:
        """Start the child, heartbeating meanwhile: a worker's first start waits for its fork server's imports
        (seconds; tens on a loaded host), longer than a heartbeat interval and, on a busy host, than the timeout
        after which another worker requeues a silent job."""
        raised: list[BaseException] = []

        def start() -> None:
            try:
                proc.start()
            except BaseException as exc:  # noqa: BLE001 - raised again in the worker's own thread
                raised.append(exc)

        starting = threading.Thread(target=start, name=f"fp8forge-job-{self.job.id[:8]}-start", daemon=True)
        starting.start()
        starting.join(self._check_every)
        while starting.is_alive():
            self._heartbeat()  # a lost job is found again by the supervision's first check
            starting.join(self._check_every)
        if raised:
            raise raised[0]

    def _supervise(self, proc: BaseProcess, receiver: Connection, stop: Any) -> None:
        next_check = 0.0
        eof = False
        while True:
            eof = eof or self._drain(receiver)
            if self.watch.result is not None:
                return  # the child's last message: its exit (torch's teardown, seconds) is not waited for
            now = time.monotonic()
            if now >= next_check:
                next_check = now + self._check_every
                if not self._heartbeat():
                    self.watch.lost = True
                    return
            w = self.watch
            if w.cancel_at is None and self.stopping.is_set() and w.shutdown_at is None:
                w.shutdown_at = now
            asked = w.cancel_at or w.shutdown_at
            if asked is not None:
                stop.set()
                overdue = now - asked - self.settings.cancel_grace_s
                if overdue > 0 and proc.is_alive():
                    # a run stuck between steps (or in a hung call) is stopped by force
                    if overdue < _KILL_AFTER_TERM_S:
                        proc.terminate()
                    else:
                        proc.kill()
            if not proc.is_alive() and (eof or not receiver.poll()):
                for _ in range(100):  # everything the child sent before it exited, the result included
                    if eof or (eof := self._drain(receiver)):
                        break
                return
            if eof:
                time.sleep(0.1)

    def _drain(self, receiver: Connection) -> bool:
        """Handle pending messages for up to ~0.2 s; True once the child closed its end."""
        # Bounded, so a chatty child (a progress message per step) cannot starve heartbeats and cancel checks.
        deadline = time.monotonic() + 0.2
        try:
            while receiver.poll(max(0.0, deadline - time.monotonic())):
                self._handle(receiver.recv())
                if time.monotonic() >= deadline:
                    return False
        except (EOFError, OSError):
            return True
        return False

    def _handle(self, msg: ChildMessage) -> None:
        w = self.watch
        match msg:
            case StageStarted(stage=stage) if w.stage is not None and stage == w.stage.value:
                pass  # resolve, which the child announced before its imports: it goes on
            case StageStarted(stage=stage):
                self._end_stage()
                w.stage, w.done, w.total, w.stage_started = Stage(stage), 0, 0, time.monotonic()
                w.last_progress_event = 0.0  # the first step of every stage is always reported
                self._emit("stage", {"stage": w.stage.value})
                self._heartbeat()
            case Progress(done=done, total=total, unit=unit, detail=detail):
                w.done, w.total = done, total
                now = time.monotonic()
                step = detail.get("step")  # what the stage does now: each new one is reported, however soon
                if now - w.last_progress_event >= _PROGRESS_EVENT_EVERY_S or w.done >= w.total \
                        or step != w.last_progress_step:
                    w.last_progress_event, w.last_progress_step = now, step
                    stage = w.stage.value if w.stage else ""
                    self._emit("progress", progress_event(stage, w.done, w.total, unit, **detail))
            case Warned(message=message):
                self._emit("warning", {"message": message})
            case Succeeded() | Failed():
                self._end_stage()  # the run is over; the child's own teardown is not stage time
                w.result = msg
            case _:
                logger.error("job %s: the conversion child sent an unknown message %r", self.job.id, msg)

    def _end_stage(self) -> None:
        w = self.watch
        if w.stage is not None and w.stage_started is not None:
            w.durations.append((w.stage.value, time.monotonic() - w.stage_started))
            w.stage_started = None

    def _heartbeat(self) -> bool:
        """Refresh the job's heartbeat; False once the job is lost (taken, or the store silent for too long)."""
        w = self.watch
        try:
            status = self.store.heartbeat_job(self.job.id, self.worker_id, attempt=self.job.attempt, stage=w.stage,
                                              done=w.done, total=w.total)
        except DBAPIError as exc:
            return self._store_failed(exc)
        if w.store_failing_since is not None:
            logger.info("job %s: the job store answers again", self.job.id)
            w.store_failing_since = None
        if status is None:
            return False
        if status is JobStatus.CANCELLING and w.cancel_at is None:
            w.cancel_at = time.monotonic()
        try:
            self.store.workers.heartbeat(self.worker_id, self.job.id)
        except DBAPIError as exc:
            logger.warning("job %s: worker heartbeat failed (%s)", self.job.id, brief(exc),
                           exc_info=not lock_refused(exc))
        self._flush_events()
        return True

    def _store_failed(self, exc: DBAPIError) -> bool:
        """Note a failed store call; False once the store has failed for ``heartbeat_timeout_s`` on end."""
        w, now = self.watch, time.monotonic()
        if w.store_failing_since is None:
            w.store_failing_since = now
            # a lock held elsewhere past the lock timeout is "not now", not a broken store: no traceback
            logger.warning("job %s: the job store does not answer (%s); the run goes on meanwhile", self.job.id,
                           brief(exc), exc_info=not lock_refused(exc))
        return now - w.store_failing_since < self.settings.heartbeat_timeout_s

    def _emit(self, kind: str, data: dict[str, Any]) -> None:
        self.watch.pending_events.append((kind, data))
        if self.watch.store_failing_since is None:  # else the next good heartbeat sends them
            self._flush_events()

    def _flush_events(self, *, strict: bool = False) -> None:
        """Write the events held back so far, in order (``strict``: a store error propagates)."""
        pending = self.watch.pending_events
        try:
            while pending:
                kind, data = pending[0]
                if not self.store.events.add(self.job.id, kind, data, worker_id=self.worker_id,
                                            attempt=self.job.attempt):
                    pending.clear()  # the job is no longer ours; the next heartbeat (or the outcome) notices
                    return
                pending.popleft()
        except DBAPIError as exc:
            if strict:
                raise
            self._store_failed(exc)


def ensure_dead(proc: BaseProcess) -> None:
    """Stop ``proc`` (SIGTERM, then SIGKILL after 3 s) and reap it."""
    if proc.is_alive():
        proc.terminate()
        proc.join(3)
    if proc.is_alive():
        proc.kill()
    proc.join()
