"""Runs one claimed job: spawn the conversion child, relay its reports, heartbeat, honour cancel, record.

The worker process is the parent; the child (``service.child``) is started with the ``spawn`` method so it
never inherits CUDA or lock state, and dies with its worker. Each attempt writes into its own directory; only
this worker, while it still owns the attempt, renames it to the job's final directory, inside the transaction
that records the success. Every other outcome (failure, cancel, requeue, a lost job) removes the attempt's
directory. A database that stops answering for a while does not stop the run: heartbeats and events are
retried until ``heartbeat_timeout_s`` of continuous failures, after which the job counts as lost.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from sqlalchemy.exc import DBAPIError

from service.artifacts import ArtifactDirs
from service.child import child_main
from service.config import Settings
from service.errors import InvalidTransition, JobNotFound
from service.jobs import Job, JobStatus, Stage
from service.store import JobLost, JobStore

__all__ = ["JobRun"]

logger = logging.getLogger(__name__)

_PROGRESS_EVENT_EVERY_S = 1.0
_KILL_AFTER_TERM_S = 1.0
_RECORD_TRIES = 4
_RECORD_BACKOFF_S = 0.5  # doubled after every failed try
_PENDING_EVENTS = 1000  # kept while the store is unreachable; the oldest go first


@dataclass
class _Watch:
    """What the worker has learned about the running child so far."""

    stage: Stage | None = None
    done: int = 0
    total: int = 0
    stage_started: float | None = None
    durations: list[tuple[str, float]] = field(default_factory=list)
    result: tuple[Any, ...] | None = None
    cancel_at: float | None = None
    shutdown_at: float | None = None
    lost: bool = False
    last_progress_event: float = 0.0
    store_failing_since: float | None = None
    pending_events: deque[tuple[str, dict[str, Any]]] = field(default_factory=lambda: deque(maxlen=_PENDING_EVENTS))


class JobRun:
    """One attempt of one job on this worker."""

    def __init__(
        self, settings: Settings, store: JobStore, dirs: ArtifactDirs, worker_id: str, job: Job,
        stopping: threading.Event,
    ) -> None:
        self.settings, self.store, self.dirs = settings, store, dirs
        self.worker_id, self.job, self.stopping = worker_id, job, stopping
        self.watch = _Watch()
        self._check_every = min(settings.heartbeat_interval_s, 0.5)

    def execute(self) -> JobStatus | None:
        """Run the attempt to its end; returns the status recorded (None if the job was lost)."""
        job_id, attempt = self.job.id, self.job.attempt
        self.dirs.ensure()
        # Leftovers of this and earlier attempts (and a final dir whose success was never recorded): this worker
        # owns the job now, so nobody else may publish it; a newer attempt's directory is never touched.
        self.dirs.remove(job_id, below_attempt=attempt + 1)
        ctx = mp.get_context("spawn")
        receiver, sender = ctx.Pipe(duplex=False)
        stop = ctx.Event()
        proc = ctx.Process(
            target=child_main, name=f"fp8forge-job-{job_id[:8]}",
            args=(dict(self.job.request), str(self.dirs.attempt_dir(job_id, attempt)),
                  self.settings.model_sources(), sender, stop, os.getpid()),
        )
        proc.start()
        sender.close()
        try:
            self._supervise(proc, receiver, stop)
        finally:
            _ensure_dead(proc)
            receiver.close()
        if self.watch.lost:
            logger.warning("job %s was taken from this worker (or its store stayed unreachable); its result is "
                           "discarded", job_id)
            self.dirs.remove_attempt(job_id, attempt)
            return None
        return self._record(proc.exitcode)

    # -- supervision -------------------------------------------------------------------------------
    def _supervise(self, proc: BaseProcess, receiver: Connection, stop: Any) -> None:
        next_check = 0.0
        eof = False
        while True:
            eof = eof or self._drain(receiver)
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

    def _handle(self, msg: tuple[Any, ...]) -> None:
        w, kind = self.watch, msg[0]
        if kind == "stage":
            self._end_stage()
            w.stage, w.done, w.total, w.stage_started = Stage(msg[1]), 0, 0, time.monotonic()
            w.last_progress_event = 0.0  # the first step of every stage is always reported
            self._emit("stage", {"stage": w.stage.value})
            self._heartbeat()
        elif kind == "progress":
            w.done, w.total = msg[1], msg[2]
            now = time.monotonic()
            if now - w.last_progress_event >= _PROGRESS_EVENT_EVERY_S or w.done >= w.total:
                w.last_progress_event = now
                stage = w.stage.value if w.stage else None
                self._emit("progress", {"stage": stage, "done": w.done, "total": w.total})
        elif kind == "warning":
            self._emit("warning", {"message": msg[1]})
        else:
            self._end_stage()  # the run is over; the child's own teardown is not stage time
            w.result = msg

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
        except DBAPIError:
            return self._store_failed()
        if w.store_failing_since is not None:
            logger.info("job %s: the job store answers again", self.job.id)
            w.store_failing_since = None
        if status is None:
            return False
        if status is JobStatus.CANCELLING and w.cancel_at is None:
            w.cancel_at = time.monotonic()
        try:
            self.store.heartbeat_worker(self.worker_id, self.job.id)
        except DBAPIError:
            logger.warning("job %s: worker heartbeat failed", self.job.id, exc_info=True)
        self._flush_events()
        return True

    def _store_failed(self) -> bool:
        """Note a failed store call; False once the store has failed for ``heartbeat_timeout_s`` on end."""
        w, now = self.watch, time.monotonic()
        if w.store_failing_since is None:
            w.store_failing_since = now
            logger.warning("job %s: the job store does not answer; the run goes on meanwhile", self.job.id,
                           exc_info=True)
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
                if not self.store.add_event(self.job.id, kind, data, worker_id=self.worker_id,
                                            attempt=self.job.attempt):
                    pending.clear()  # the job is no longer ours; the next heartbeat (or the outcome) notices
                    return
                pending.popleft()
        except DBAPIError:
            if strict:
                raise
            self._store_failed()

    # -- outcome -----------------------------------------------------------------------------------
    def _record(self, exitcode: int | None) -> JobStatus | None:
        """Record the attempt's outcome, retrying a store that fails for a moment."""
        job_id, attempt = self.job.id, self.job.attempt
        self._end_stage()
        try:
            self.store.record_stage_durations(job_id, self.watch.durations)
        except DBAPIError:
            logger.warning("job %s: stage timings not recorded", job_id, exc_info=True)
        delay = _RECORD_BACKOFF_S
        for left in reversed(range(_RECORD_TRIES)):
            try:
                self._flush_events(strict=True)  # the run's last events come before its final status
                return self._outcome(exitcode)
            except (JobLost, JobNotFound):
                logger.warning("job %s was taken from this worker before its outcome was recorded", job_id)
                self.dirs.remove_attempt(job_id, attempt)
                return None
            except (DBAPIError, InvalidTransition) as exc:  # the store failed, or the job kept changing
                if not left:
                    logger.error("job %s: could not record its outcome (%s); it is requeued once its heartbeat "
                                 "is stale", job_id, exc)
                    break
                logger.warning("job %s: recording its outcome failed (%s); retrying in %.1fs", job_id, exc, delay)
                time.sleep(delay)  # a back-off between tries, not a wait for another process
                delay *= 2
        self.dirs.remove_attempt(job_id, attempt)
        return None

    def _outcome(self, exitcode: int | None) -> JobStatus:
        w = self.watch
        if w.cancel_at is not None:
            return self._finish(JobStatus.CANCELLED)
        if w.result is not None and w.result[0] == "done":
            return self._succeed(w.result[1])
        if w.shutdown_at is not None:
            return self._requeue("worker_shutdown", count_attempt=False)
        if w.result is not None:
            return self._finish(JobStatus.FAILED, error_code=w.result[1], error_message=w.result[2])
        return self._crashed(f"the conversion process exited with code {exitcode} without a result")

    def _succeed(self, manifest: list[dict[str, Any]]) -> JobStatus:
        job_id, attempt = self.job.id, self.job.attempt
        artifacts = self.dirs.index(job_id, manifest, attempt=attempt)
        published = False

        def publish() -> None:  # runs while the job's row is locked by the write that records the success
            nonlocal published
            self.dirs.publish(job_id, attempt)
            published = True

        try:
            status = self._set(JobStatus.SUCCEEDED, artifacts=artifacts, before_commit=publish)
        except OSError as exc:  # the attempt's files could not be moved into place; nothing was recorded
            return self._crashed(f"the artifacts could not be published: {exc}")
        except JobLost:
            if not self._recorded_as_succeeded():
                raise
            status = JobStatus.SUCCEEDED  # an earlier try committed although it reported a failure
            if not self.dirs.final_dir(job_id).exists():
                self.dirs.publish(job_id, attempt)
        except BaseException:
            if published:
                self.dirs.unpublish(job_id, attempt)  # the success was not recorded: the files go back
            raise
        if status is not JobStatus.SUCCEEDED:  # a cancel won: the user asked for nothing
            self.dirs.remove_attempt(job_id, attempt)
        return status

    def _recorded_as_succeeded(self) -> bool:
        job = self.store.get_job(self.job.id)
        return (job.status is JobStatus.SUCCEEDED and job.worker_id == self.worker_id
                and job.attempt == self.job.attempt)

    def _crashed(self, message: str) -> JobStatus:
        if self.job.attempt < self.job.max_attempts:
            return self._requeue("conversion_crashed", message=message)
        return self._finish(JobStatus.FAILED, error_code="worker_crashed", error_message=message)

    def _requeue(self, reason: str, *, count_attempt: bool = True, message: str = "") -> JobStatus:
        self.dirs.remove_attempt(self.job.id, self.job.attempt)  # before the job is another worker's to claim
        attempt = self.job.attempt if count_attempt else self.job.attempt - 1
        return self._set(JobStatus.QUEUED, worker_id=None, attempt=attempt,
                         event={"reason": reason, "message": message})

    def _finish(self, status: JobStatus, **errors: Any) -> JobStatus:
        self.dirs.remove_attempt(self.job.id, self.job.attempt)
        event = {"error": {"code": errors["error_code"], "message": errors["error_message"]}} if errors else {}
        return self._set(status, event=event, **errors)

    def _set(
        self, target: JobStatus, *, event: dict[str, Any] | None = None,
        before_commit: Callable[[], None] | None = None, **values: Any,
    ) -> JobStatus:
        """Record ``target`` as the owner of this attempt; returns the status recorded.

        A cancel that arrived after the last heartbeat wins over a success or a requeue: the job ends
        ``cancelled`` (and ``before_commit`` does not run).

        Raises:
            JobLost: the attempt is no longer this worker's. InvalidTransition: the job kept changing.
            DBAPIError: the store failed.
        """
        for _ in range(3):
            try:
                self.store.set_status(self.job.id, target, owner=self.worker_id, owner_attempt=self.job.attempt,
                                      event=event, before_commit=before_commit, **values)
                return target
            except InvalidTransition:
                current = self.store.get_job(self.job.id)
                if current.status is JobStatus.CANCELLING and target in (JobStatus.SUCCEEDED, JobStatus.QUEUED):
                    target, event, before_commit, values = JobStatus.CANCELLED, None, None, {}
                # otherwise it was still running but changed under every try; the owner check decides next
        raise InvalidTransition(f"job {self.job.id} kept changing while its outcome was recorded")


def _ensure_dead(proc: BaseProcess) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(3)
    if proc.is_alive():
        proc.kill()
    proc.join()
