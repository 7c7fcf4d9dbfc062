"""Runs one claimed job: spawn the conversion child, relay its reports, heartbeat, honour cancel, record.

The worker process is the parent; the child (``service.child``) is started with the ``spawn`` method so it
never inherits CUDA or lock state, and dies with its worker. Files only appear in the job's final directory
when the pipeline renamed its staging directory into place; every other outcome removes both.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from service.artifacts import ArtifactDirs
from service.child import child_main
from service.config import Settings
from service.errors import InvalidTransition
from service.jobs import Job, JobStatus, Stage
from service.store import JobLost, JobStore

__all__ = ["JobRun"]

logger = logging.getLogger(__name__)

_PROGRESS_EVENT_EVERY_S = 1.0
_KILL_AFTER_TERM_S = 1.0


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
        self.dirs.ensure()
        self.dirs.remove(self.job.id)  # leftovers of an earlier attempt
        ctx = mp.get_context("spawn")
        receiver, sender = ctx.Pipe(duplex=False)
        stop = ctx.Event()
        proc = ctx.Process(
            target=child_main, name=f"fp8forge-job-{self.job.id[:8]}",
            args=(dict(self.job.request), str(self.dirs.final_dir(self.job.id)), self.settings.model_sources(),
                  sender, stop, os.getpid()),
        )
        proc.start()
        sender.close()
        try:
            self._supervise(proc, receiver, stop)
        finally:
            _ensure_dead(proc)
            receiver.close()
        if self.watch.lost:
            logger.warning("job %s was taken from this worker; its result is discarded", self.job.id)
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
            self.store.add_event(self.job.id, "stage", {"stage": w.stage.value})
            self._heartbeat()
        elif kind == "progress":
            w.done, w.total = msg[1], msg[2]
            now = time.monotonic()
            if now - w.last_progress_event >= _PROGRESS_EVENT_EVERY_S or w.done >= w.total:
                w.last_progress_event = now
                stage = w.stage.value if w.stage else None
                self.store.add_event(self.job.id, "progress", {"stage": stage, "done": w.done, "total": w.total})
        elif kind == "warning":
            self.store.add_event(self.job.id, "warning", {"message": msg[1]})
        else:
            self._end_stage()  # the run is over; the child's own teardown is not stage time
            w.result = msg

    def _end_stage(self) -> None:
        w = self.watch
        if w.stage is not None and w.stage_started is not None:
            w.durations.append((w.stage.value, time.monotonic() - w.stage_started))
            w.stage_started = None

    def _heartbeat(self) -> bool:
        w = self.watch
        status = self.store.heartbeat_job(self.job.id, self.worker_id, stage=w.stage, done=w.done, total=w.total)
        if status is None:
            return False
        if status is JobStatus.CANCELLING and w.cancel_at is None:
            w.cancel_at = time.monotonic()
        self.store.heartbeat_worker(self.worker_id, self.job.id)
        return True

    # -- outcome -----------------------------------------------------------------------------------
    def _record(self, exitcode: int | None) -> JobStatus | None:
        w = self.watch
        self._end_stage()
        self.store.record_stage_durations(self.job.id, w.durations)
        try:
            if w.cancel_at is not None:
                return self._finish(JobStatus.CANCELLED)
            if w.result is not None and w.result[0] == "done":
                return self._succeed(w.result[1])
            if w.shutdown_at is not None:
                return self._requeue("worker_shutdown", count_attempt=False)
            if w.result is not None:
                return self._finish(JobStatus.FAILED, error_code=w.result[1], error_message=w.result[2])
            return self._crashed(exitcode)
        except JobLost:
            logger.warning("job %s was taken from this worker before its outcome was recorded", self.job.id)
            return None

    def _succeed(self, manifest: list[dict[str, Any]]) -> JobStatus:
        artifacts = self.dirs.index(self.job.id, manifest)
        try:
            self.store.set_status(self.job.id, JobStatus.SUCCEEDED, owner=self.worker_id, artifacts=artifacts)
        except InvalidTransition:  # a cancel arrived after the last check: the user asked for nothing
            return self._finish(JobStatus.CANCELLED)
        return JobStatus.SUCCEEDED

    def _crashed(self, exitcode: int | None) -> JobStatus:
        message = f"the conversion process exited with code {exitcode} without a result"
        if self.job.attempt < self.job.max_attempts:
            return self._requeue("conversion_crashed", message=message)
        return self._finish(JobStatus.FAILED, error_code="worker_crashed", error_message=message)

    def _requeue(self, reason: str, *, count_attempt: bool = True, message: str = "") -> JobStatus:
        self.dirs.remove(self.job.id)
        attempt = self.job.attempt if count_attempt else self.job.attempt - 1
        try:
            self.store.set_status(self.job.id, JobStatus.QUEUED, owner=self.worker_id, worker_id=None,
                                  attempt=attempt, event={"reason": reason, "message": message})
        except InvalidTransition:  # cancelled meanwhile
            return self._finish(JobStatus.CANCELLED)
        return JobStatus.QUEUED

    def _finish(self, status: JobStatus, **errors: Any) -> JobStatus:
        self.dirs.remove(self.job.id)
        event = {"error": {"code": errors["error_code"], "message": errors["error_message"]}} if errors else {}
        self.store.set_status(self.job.id, status, owner=self.worker_id, event=event, **errors)
        return status


def _ensure_dead(proc: BaseProcess) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(3)
    if proc.is_alive():
        proc.kill()
    proc.join()
