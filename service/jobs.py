"""The job state machine: stored statuses, the one table of allowed transitions, and job records."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from converters.pipeline.state import STAGES, Stage, job_stages  # the pipeline's own stage list
from service.errors import InvalidTransition

__all__ = ["JobStatus", "Stage", "STAGES", "TRANSITIONS", "transition", "Job", "JobEvent", "TaskStatus", "Task",
           "public_worker_name"]


class JobStatus(str, enum.Enum):
    """Where a job is in its life. Stored as its value; never inferred from side data."""

    #: Waiting for a worker to claim it.
    QUEUED = "queued"
    #: Claimed by a worker that heartbeats while the pipeline runs.
    RUNNING = "running"
    #: Finished; its artifacts are in place and listed.
    SUCCEEDED = "succeeded"
    #: Finished with ``error_code``/``error_message``; nothing was left behind.
    FAILED = "failed"
    #: A cancel was requested while running; the worker is stopping the pipeline.
    CANCELLING = "cancelling"
    #: Finished by a cancel; nothing was left behind.
    CANCELLED = "cancelled"

    @property
    def is_finished(self) -> bool:
        return not TRANSITIONS[self]



_S = JobStatus
#: The one table of allowed status changes. A status with no way out is a finished one.
TRANSITIONS: Mapping[JobStatus, frozenset[JobStatus]] = {
    # claimed by a worker; cancelled before any worker got it
    _S.QUEUED: frozenset({_S.RUNNING, _S.CANCELLED}),
    # done; failed; cancel requested; worker lost or shut down (requeued for another attempt)
    _S.RUNNING: frozenset({_S.SUCCEEDED, _S.FAILED, _S.CANCELLING, _S.QUEUED}),
    # the worker stopped the run; or the worker was lost and the run could not be confirmed stopped
    _S.CANCELLING: frozenset({_S.CANCELLED, _S.FAILED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


def transition(current: JobStatus, target: JobStatus) -> JobStatus:
    """Check that a job may go from ``current`` to ``target``; returns ``target``.

    Raises:
        InvalidTransition: the table does not allow it (HTTP 409).
    """
    if target not in TRANSITIONS[current]:
        if current.is_finished:
            message = f"job is already {current.value} and cannot become {target.value}"
        else:
            message = f"a {current.value} job cannot become {target.value}"
        raise InvalidTransition(message)
    return target


@dataclass(frozen=True, kw_only=True)
class Job:
    """One stored job. Times are seconds since the epoch (UTC)."""

    id: str
    seq: int
    status: JobStatus
    request: Mapping[str, Any]
    attempt: int = 0
    max_attempts: int = 1
    stage: Stage | None = None
    stage_done: int = 0
    stage_total: int = 0
    created_at: float
    updated_at: float
    started_at: float | None = None
    finished_at: float | None = None
    heartbeat_at: float | None = None
    worker_id: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    artifacts: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)
    idempotency_key: str | None = None
    owner: str | None = None  #: name of the API key that created it; None on a server without keys

    @property
    def progress(self) -> float:
        """Overall fraction done: finished stages plus the fraction of the current one, of the stages this job
        runs (``job_stages``: a requantize job runs three, a conversion the quality stage too, a plan's the plan)."""
        if self.status is JobStatus.SUCCEEDED:
            return 1.0
        if self.stage is None:
            return 0.0
        stages = job_stages(self.request)
        stages = stages if self.stage in stages else STAGES
        within = self.stage_done / self.stage_total if self.stage_total > 0 else 0.0
        return round((stages.index(self.stage) + min(within, 1.0)) / len(stages), 4)


@dataclass(frozen=True, kw_only=True)
class JobEvent:
    """One entry of a job's event log: ``kind`` is status, stage, progress or warning."""

    seq: int
    job_id: str
    at: float
    kind: str
    data: Mapping[str, Any]


class TaskStatus(str, enum.Enum):
    """Where one task of a job split into tasks is (a requantize job's plan, shard and finish tasks)."""

    #: Waiting for its phase (every task of a lower phase succeeded) and a worker.
    QUEUED = "queued"
    #: Claimed by a worker that heartbeats it; a silent one is requeued (a new attempt) or fails the job.
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    #: Its last attempt failed; the job failed with it, naming the task's shard.
    FAILED = "failed"
    #: Dropped: the job was cancelled or failed before this task finished.
    CANCELLED = "cancelled"


@dataclass(frozen=True, kw_only=True)
class Task:
    """One stored task of a job: ``kind`` (``service.workers.task_kinds.TASK_KINDS``) runs at ``phase``, for one
    ``shard`` or None."""

    seq: int
    job_id: str
    kind: str
    phase: int
    shard: str | None
    source: str  #: the model reference it reads (which hosts hold it is what the claim prefers)
    payload: Mapping[str, Any]
    status: TaskStatus
    attempt: int
    max_attempts: int
    worker_id: str | None = None
    host: str | None = None
    result: Mapping[str, Any] | None = None

    @property
    def name(self) -> str:
        """How messages name it: its shard, or its kind."""
        return f"shard {self.shard}" if self.shard else f"the {self.kind} task"

    @property
    def queued_by_attempt(self) -> int | None:
        """The job attempt that queued it, for a task only that attempt waits for (a calibrated job's serving
        shards); None for a task its job's every attempt may run."""
        return self.payload.get("attempt")


def public_worker_name(worker_id: str | None) -> str | None:
    """What clients see of a worker id: a stable opaque name (the id names a host and a PID, kept for logs)."""
    return None if worker_id is None else "w-" + hashlib.sha256(worker_id.encode()).hexdigest()[:12]
