"""Jobs split into tasks (a requantize job): splitting one, and settling it when a task fails, goes silent or the
job is cancelled.

Any process may call these (the task's own worker, other workers between tasks, the API's reaper): every change
is a compare-and-set in the store, so two settling the same job at once do no harm.
"""

from __future__ import annotations

import logging
from typing import Any

from service.artifacts import ArtifactStorage
from service.errors import InvalidTransition, JobNotFound
from service.jobs import Job, JobStatus, Task, TaskStatus
from service.store import JobStore
from service.store.tasks import HostFaultRetry
from service.workers.task_kinds import plan_payload

__all__ = ["fail_job", "is_split_job", "reap_stale_tasks", "settle", "split_job"]

logger = logging.getLogger(__name__)


def is_split_job(request: dict[str, Any]) -> bool:
    """Whether a job runs as tasks spread over the workers (a requantize job) instead of in one worker."""
    return request.get("requantize") is not None


def split_job(store: JobStore, dirs: ArtifactStorage, worker_id: str, job: Job, max_attempts: int) -> bool:
    """Turn a job this worker has just claimed into its plan task; False when the job was taken meanwhile."""
    dirs.remove(job.id, below_attempt=job.attempt + 1)  # what an earlier attempt left (it crashed before splitting)
    split = store.tasks.split(job.id, worker_id, job.attempt, source=job.request["model"],
                              payload=plan_payload(job.request), max_attempts=max_attempts)
    if split:
        logger.info("job %s: split into tasks; its plan task is queued", job.id)
    return split


def fail_job(store: JobStore, dirs: ArtifactStorage, job_id: str, code: str, message: str) -> JobStatus | None:
    """Fail a split job (its queued tasks are dropped, running ones stop at their next heartbeat, its files go);
    returns the status it ended in (cancelled when a cancel came first), or None if it had already finished."""
    for _ in range(5):
        try:
            job = store.get_job(job_id)
        except JobNotFound:
            return None
        if job.status.is_finished:
            return None
        target = JobStatus.CANCELLED if job.status is JobStatus.CANCELLING else JobStatus.FAILED
        errors = {"error_code": code, "error_message": message} if target is JobStatus.FAILED else {}
        event = {"error": {"code": code, "message": message}} if errors else {"reason": "cancel requested"}
        try:
            store.set_status(job_id, target, event=event, **errors)
        except InvalidTransition:
            continue  # it changed meanwhile: look again
        store.tasks.drop(job_id)
        dirs.remove(job_id)
        logger.warning("job %s: %s (%s)", job_id, target.value, message)
        return target
    return None


def settle(store: JobStore, dirs: ArtifactStorage, job_id: str) -> None:
    """Drop a cancelling or finished job's queued tasks; a cancelling one whose tasks have all stopped is cancelled
    and its files removed."""
    running = store.tasks.drop(job_id)
    try:
        job = store.get_job(job_id)
    except JobNotFound:
        return
    if job.status is not JobStatus.CANCELLING or running or not store.tasks.is_split(job_id):
        return  # a calibrated job handing out serving shards is cancelled by its own worker
    try:
        store.set_status(job_id, JobStatus.CANCELLED, event={"reason": "cancel requested"})
    except InvalidTransition:
        return
    dirs.remove(job_id)
    logger.info("job %s: cancelled; every task has stopped", job_id)


def reap_stale_tasks(store: JobStore, dirs: ArtifactStorage, timeout_s: float) -> list[tuple[int, TaskStatus]]:
    """Requeue every task silent for ``timeout_s`` (or fail its job after its last attempt), then settle cancelled
    and finished split jobs; returns the tasks changed."""
    changed = []
    for task in store.tasks.stale(timeout_s):
        changed.append((task.seq, _reap(store, dirs, task, timeout_s)))
    for job_id in store.tasks.settling():
        settle(store, dirs, job_id)
    return [(seq, status) for seq, status in changed if status is not None]


def _reap(store: JobStore, dirs: ArtifactStorage, task: Task, timeout_s: float) -> TaskStatus | None:
    try:
        job = store.get_job(task.job_id)
    except JobNotFound:
        job = None
    if job is None or job.status is not JobStatus.RUNNING:
        return TaskStatus.CANCELLED if store.tasks.release(task, TaskStatus.CANCELLED, stale_for_s=timeout_s) else None
    lost = f"its worker stopped heartbeating for {timeout_s:g}s on attempt {task.attempt} of {task.max_attempts}"
    retry, hosts = store.tasks.release_host_fault(task, stale_for_s=timeout_s, error=("worker_lost", lost))
    if retry is HostFaultRetry.CHANGED:
        return None
    if retry is HostFaultRetry.ELSEWHERE:  # a lost worker is a fault of its host: another host runs it
        message = f"{task.name}: {lost}; it runs again on another host, without using up an attempt"
        logger.warning("job %s: %s", task.job_id, message)
        store.events.add(task.job_id, "warning", {"message": message, "reason": "worker_lost", "shard": task.shard,
                                                  **hosts})
        return TaskStatus.QUEUED
    if task.attempt < task.max_attempts:
        if not store.tasks.release(task, TaskStatus.QUEUED, stale_for_s=timeout_s, error=("worker_lost", lost)):
            return None
        logger.warning("job %s: %s: %s; it runs again", task.job_id, task.name, lost)
        store.events.add(task.job_id, "warning", {"message": f"{task.name}: {lost}; it runs again",
                                                  "reason": "worker_lost", "shard": task.shard})
        return TaskStatus.QUEUED
    if not store.tasks.release(task, TaskStatus.FAILED, stale_for_s=timeout_s, error=("worker_lost", lost)):
        return None
    fail_job(store, dirs, task.job_id, "worker_lost", f"{task.name}: {lost}; giving up")
    return TaskStatus.FAILED
