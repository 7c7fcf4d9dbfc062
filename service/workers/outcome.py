"""Recording the outcome of one job attempt: success (publishing its files), failure, cancel or requeue.

Used by ``JobRun`` (``service.workers.runner``) once the child has exited; it decides only what the store
says about the attempt and what happens to its files. A success is uploaded first where the storage is
remote (the worker heartbeats meanwhile), then published only by the attempt's owner, inside the transaction
that records it; every other outcome removes the attempt's files. An upload that fails is retried as a new
attempt, or fails the job with ``artifact_upload_failed`` after the last one. A run whose worker's disk filled up
(``disk_full``) is a fault of its host: it is retried on another host without using up an attempt
(``service.store.host_faults``). A store that fails for a moment is retried with a
back-off; a worker that finds its attempt given to another meanwhile (it was stopped, then resumed) logs that
once and leaves the new attempt's files alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import DBAPIError

from service.artifacts import ArtifactStorage, ArtifactUploadFailed
from service.errors import InvalidTransition, JobNotFound
from service.jobs import Job, JobStatus
from service.store import JobLost, JobStore
from service.store.schema import brief
from service.workers.messages import DISK_FULL, Succeeded
from service.workers.watch import RunWatch

__all__ = ["AttemptOutcome"]

logger = logging.getLogger(__name__)

_RECORD_TRIES = 4
_RECORD_BACKOFF_S = 0.5  # doubled after every failed try


class AttemptOutcome:
    """Records how one attempt ended, as told by what its ``RunWatch`` saw."""

    def __init__(
        self, store: JobStore, dirs: ArtifactStorage, worker_id: str, job: Job, watch: RunWatch, *,
        heartbeat_interval_s: float = 1.0,
    ) -> None:
        self.store, self.dirs, self.worker_id, self.job, self.watch = store, dirs, worker_id, job, watch
        self.heartbeat_interval_s = heartbeat_interval_s
        self._upload_interrupted: JobStatus | None = None  # CANCELLING, or QUEUED for a job taken away

    def record(self, exitcode: int | None, *, flush_events: Callable[..., None]) -> JobStatus | None:
        """Record the attempt's outcome, retrying a store that fails for a moment.

        ``flush_events(strict=True)`` writes the run's held-back events, which come before its final status.
        """
        job_id, attempt = self.job.id, self.job.attempt
        try:
            self.store.timings.record(job_id, self.watch.durations)
        except DBAPIError as exc:
            logger.warning("job %s: stage timings not recorded (%s)", job_id, brief(exc))
        delay = _RECORD_BACKOFF_S
        for left in reversed(range(_RECORD_TRIES)):
            try:
                flush_events(strict=True)
                return self._outcome(exitcode)
            except (JobLost, JobNotFound):
                return self._lost()
            except OSError:  # e.g. the attempt's files are gone: the next attempt's worker removed them
                if self._taken():
                    return self._lost()
                raise
            except (DBAPIError, InvalidTransition) as exc:  # the store failed, or the job kept changing
                if self._taken():  # e.g. this worker was stopped, and the job went to another meanwhile
                    return self._lost()
                if not left:
                    logger.error("job %s: could not record its outcome (%s); it is requeued once its heartbeat "
                                 "is stale", job_id, brief(exc))
                    break
                logger.warning("job %s: recording its outcome failed (%s); retrying in %.1fs", job_id, brief(exc),
                               delay)
                time.sleep(delay)  # a back-off between tries, not a wait for another process
                delay *= 2
        self.dirs.remove_attempt(job_id, attempt)
        return None

    def _lost(self) -> None:
        logger.warning("job %s was taken from this worker before its outcome was recorded (it went silent, and the "
                       "job was given to another attempt); its result is discarded", self.job.id)
        self.dirs.remove_attempt(self.job.id, self.job.attempt)

    def _taken(self) -> bool:
        """Whether this attempt is no longer the job's (requeued, claimed again, deleted); False when the store
        cannot tell."""
        try:
            job = self.store.get_job(self.job.id)
        except JobNotFound:
            return True
        except DBAPIError:
            return False
        return job.worker_id != self.worker_id or job.attempt != self.job.attempt

    def _outcome(self, exitcode: int | None) -> JobStatus:
        w = self.watch
        if w.cancel_at is not None:
            return self._finish(JobStatus.CANCELLED)
        if isinstance(w.result, Succeeded):
            return self._succeed(w.result.manifest)
        if w.shutdown_at is not None:
            return self._requeue("worker_shutdown", count_attempt=False)
        if w.result is not None and w.result.code == DISK_FULL:  # this host has no room; another may
            logger.warning("job %s: attempt %d ran out of disk space on this worker", self.job.id, self.job.attempt)
            return self._host_fault(DISK_FULL, f"{w.result.message} (attempt {self.job.attempt} of "
                                               f"{self.job.max_attempts})")
        if w.result is not None and w.result.code == "internal_error":
            # raw exception text names files, hosts and internals: the log keeps it, the client gets the fact
            logger.error("job %s: the conversion failed with an internal error: %s", self.job.id, w.result.message)
            return self._finish(JobStatus.FAILED, error_code="internal_error",
                                error_message="the conversion failed with an unexpected internal error; the "
                                              f"worker's log has the details (job {self.job.id})")
        if w.result is not None:
            return self._finish(JobStatus.FAILED, error_code=w.result.code, error_message=w.result.message)
        return self._crashed(f"the conversion process exited with code {exitcode} without a result")

    def _succeed(self, manifest: list[dict[str, Any]]) -> JobStatus:
        job_id, attempt = self.job.id, self.job.attempt
        artifacts = self.dirs.index(job_id, manifest, attempt=attempt)
        try:
            self._upload(artifacts)
        except ArtifactUploadFailed as exc:
            return self._upload_failed(exc)
        published = False

        def publish(_: object) -> None:  # runs while the job's row is locked by the write that records the success
            nonlocal published
            self.dirs.publish(job_id, attempt, artifacts)
            published = True

        try:
            status = self._set(JobStatus.SUCCEEDED, artifacts=artifacts, before_commit=publish)
        except ArtifactUploadFailed as exc:  # the store did not hold the files at the moment of publishing
            return self._upload_failed(exc)
        except OSError as exc:  # the attempt's files could not be moved into place; nothing was recorded
            logger.error("job %s: publishing attempt %d failed: %s", job_id, attempt, exc)
            return self._crashed("the artifacts could not be published (a file system error on the worker)")
        except JobLost:
            if not self._recorded_as_succeeded():
                raise
            status = JobStatus.SUCCEEDED  # an earlier try committed although it reported a failure
            if not self.dirs.is_published(job_id, attempt):
                self.dirs.publish(job_id, attempt, artifacts)
        except BaseException:
            # the success was not recorded: the files go back, unless the job is another attempt's by now (this
            # worker was stopped inside its write), whose worker removed them and may have published its own
            if published and not self._taken():
                self.dirs.unpublish(job_id, attempt)
            raise
        if status is not JobStatus.SUCCEEDED:  # a cancel won: the user asked for nothing
            self.dirs.remove_attempt(job_id, attempt)
        else:
            self.dirs.settle(job_id, attempt)
        return status

    def _upload(self, artifacts: list[dict[str, Any]]) -> None:
        """Send the attempt's files to a remote storage, heartbeating the job meanwhile (an upload can outlast
        the heartbeat timeout); a cancel or the job taken away stops it between parts.

        Raises:
            ArtifactUploadFailed.
        """
        if not self.dirs.remote:
            return
        done = threading.Event()

        def heartbeat() -> None:
            while not done.wait(self.heartbeat_interval_s):
                try:
                    status = self.store.heartbeat_job(self.job.id, self.worker_id, attempt=self.job.attempt)
                    self.store.workers.heartbeat(self.worker_id, self.job.id)  # /readyz counts this worker
                except DBAPIError:  # recording the outcome afterwards has its own retries
                    continue
                if status is None or status is JobStatus.CANCELLING:
                    self._upload_interrupted = status or JobStatus.QUEUED
                    return

        beating = threading.Thread(target=heartbeat, name=f"fp8forge-upload-{self.job.id[:8]}", daemon=True)
        beating.start()
        try:
            self.dirs.upload(self.job.id, self.job.attempt, artifacts,
                             should_stop=lambda: self._upload_interrupted is not None)
        finally:
            done.set()
            beating.join()

    def _upload_failed(self, exc: ArtifactUploadFailed) -> JobStatus:
        logger.error("job %s: attempt %d: %s", self.job.id, self.job.attempt, exc, exc_info=exc.__cause__)
        if self._upload_interrupted is JobStatus.CANCELLING:
            return self._finish(JobStatus.CANCELLED)
        if self._upload_interrupted is not None:
            raise JobLost(f"job {self.job.id} was taken from this worker during the upload")
        message = f"{exc} (attempt {self.job.attempt} of {self.job.max_attempts})"
        if self.job.attempt < self.job.max_attempts:
            return self._requeue("artifact_upload_failed", message=message)
        return self._finish(JobStatus.FAILED, error_code="artifact_upload_failed", error_message=message)

    def _recorded_as_succeeded(self) -> bool:
        job = self.store.get_job(self.job.id)
        return (job.status is JobStatus.SUCCEEDED and job.worker_id == self.worker_id
                and job.attempt == self.job.attempt)

    def _crashed(self, message: str) -> JobStatus:
        return self._retry_or_fail("conversion_crashed", "worker_crashed", message)

    def _host_fault(self, reason: str, message: str) -> JobStatus:
        """Requeue the job for a worker on another host, charging this one with the fault; once the job has had
        its host-fault retries (or this host is unknown) the fault uses up an attempt like any other."""
        fault = self.store.host_fault(self.job.id)
        if fault is None:
            return self._retry_or_fail(reason, reason, message)
        self.dirs.remove_attempt(self.job.id, self.job.attempt)  # before the job is another worker's to claim
        return self._set(JobStatus.QUEUED, worker_id=None, event={
            "reason": reason, "message": f"{message}; it runs again on another host, without using up an attempt",
            **fault.event}, **fault.values)

    def _retry_or_fail(self, reason: str, error_code: str, message: str) -> JobStatus:
        """Requeue the job for another attempt (``reason`` in its event), or fail it after the last one."""
        if self.job.attempt < self.job.max_attempts:
            return self._requeue(reason, message=message)
        return self._finish(JobStatus.FAILED, error_code=error_code, error_message=message)

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
        before_commit: Callable[[Any], None] | None = None, **values: Any,
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

