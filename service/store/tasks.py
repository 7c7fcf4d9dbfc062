"""The tasks of a job split into tasks (a requantize job): claimed, heartbeated, retried and reaped one by one.

A worker that claims such a job writes its ``plan`` task (:meth:`TaskQueue.split`); the plan's result adds the
shard tasks and the ``finish`` task. A task may be claimed once every task of its job with a lower ``phase`` has
succeeded and while the job is running, so a cancelled or failed job's queued tasks are never claimed (and are
marked cancelled by :meth:`TaskQueue.drop`). Every write is a compare-and-set on the task's status and, for its
worker, on ``worker_id`` and ``attempt``, as for jobs; heartbeats use the database clock.

The job row stays ``running`` meanwhile; its own heartbeat is not watched (``JobStore.find_stale`` leaves split
jobs to their tasks). Its ``stage``/``stage_done``/``stage_total`` count the tasks: shards done / total.

A calibrated job whose serving export runs as shard tasks is not split: its conversion stays in its worker, which
adds ``serving_write`` tasks (:meth:`TaskQueue.add_serving_writes`) and waits for them, and the job keeps living by
its own heartbeat. Such tasks carry the job's attempt in their payload; a task of an earlier attempt is never
waited for.

Tasks come in one form (``service.workers.task_kinds.ShardTask``, parsed here from their wire form) and their kinds'
stages, phases and shard counts come from that module's registry.
"""

from __future__ import annotations

import enum
import json
import time
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from converters.pipeline.progress import Unit, progress_event
from service.jobs import JobStatus, Stage, Task, TaskStatus
from service.store.events import EventLog
from service.store.host_faults import avoided_by, charge, live_hosts, public_host_name, this_host
from service.store.schema import Tables
from service.workers.task_kinds import SERVING_WRITE, TASK_KINDS, ShardTask

__all__ = ["SERVING_WRITE", "HostFaultRetry", "TaskQueue", "this_host"]

_RUNNING, _QUEUED = TaskStatus.RUNNING.value, TaskStatus.QUEUED.value
#: The job stage each task kind counts towards, in the order the kinds run.
_STAGE_OF = {name: kind.stage for name, kind in TASK_KINDS.items()}
#: The kinds whose tasks are a job's shards (events count them as shards_done / shards_total).
_SHARD_KINDS = tuple(name for name, kind in TASK_KINDS.items() if kind.is_shard)
#: The kinds whose job stays its worker's while they run (not a split job: its own heartbeat is watched).
_WORKER_KEPT_KINDS = tuple(name for name, kind in TASK_KINDS.items() if not kind.drives_job)


class HostFaultRetry(str, enum.Enum):
    """What :meth:`TaskQueue.release_host_fault` did."""

    #: Requeued for another host, using up none of its attempts.
    ELSEWHERE = "elsewhere"
    #: Nothing: its host is unknown, or it has had its host-fault retries; retry or fail it as any other failure.
    SPENT = "spent"
    #: Nothing: it changed meanwhile (it is no longer this worker's, or it heartbeated again).
    CHANGED = "changed"


class TaskQueue:
    """The ``job_tasks`` table of one store."""

    def __init__(self, engine: Engine, tables: Tables, db_now: sa.ColumnElement[float], events: EventLog) -> None:
        self._engine, self._tasks, self._jobs, self._db_now, self._events = (
            engine, tables.tasks, tables.jobs, db_now, events)
        self._workers = tables.workers

    # -- a job becomes tasks ---------------------------------------------------------------------------
    def split(self, job_id: str, worker_id: str, attempt: int, *, source: str, payload: Mapping[str, Any],
              max_attempts: int) -> bool:
        """Store the plan task of a job ``worker_id`` has just claimed; False when the job is no longer its own."""
        now, j = time.time(), self._jobs
        with self._engine.begin() as conn:
            owned = conn.execute(sa.update(j).where(
                j.c.id == job_id, j.c.worker_id == worker_id, j.c.attempt == attempt,
                j.c.status == JobStatus.RUNNING.value).values(
                    stage=Stage.ANALYZE.value, stage_done=0, stage_total=1, heartbeat_at=self._db_now)).rowcount
            if not owned:
                return False
            self._insert(conn, job_id, source, [ShardTask("plan", None, payload)], max_attempts, now)
            self._events.append(conn, job_id, "stage", {"stage": Stage.ANALYZE.value, "tasks": 1}, now)
        return True

    def add_serving_writes(self, job_id: str, worker_id: str, attempt: int, *, source: str,
                           tasks: Iterable[Mapping[str, Any]], max_attempts: int) -> bool:
        """Queue a calibrated job's ``serving_write`` tasks (in their wire form, ``ShardTask.from_dict``'s; each
        payload gets the attempt) for any worker to claim; False when the job is no longer ``worker_id``'s attempt.
        Queued tasks of an earlier attempt are cancelled in the same transaction."""
        now, j, t = time.time(), self._jobs, self._tasks
        parsed = [ShardTask.from_dict(task) for task in tasks]
        rows = [ShardTask(task.kind, task.shard, {**task.payload, "attempt": attempt}) for task in parsed]
        with self._engine.begin() as conn:
            owned = conn.execute(sa.update(j).where(
                j.c.id == job_id, j.c.worker_id == worker_id, j.c.attempt == attempt,
                j.c.status == JobStatus.RUNNING.value).values(heartbeat_at=self._db_now)).rowcount
            if not owned:
                return False
            conn.execute(sa.update(t).where(t.c.job_id == job_id, t.c.status == _QUEUED).values(
                status=TaskStatus.CANCELLED.value, finished_at=now))
            self._insert(conn, job_id, source, rows, max_attempts, now)
            self._progress(conn, job_id, now)
        return True

    def serving_writes(self, job_id: str, attempt: int) -> list[Task]:
        """The job's ``serving_write`` tasks of ``attempt``, in the order they were queued."""
        return [task for task in self.of_job(job_id, kind=SERVING_WRITE) if task.payload.get("attempt") == attempt]

    def _insert(self, conn: sa.Connection, job_id: str, source: str, tasks: Iterable[ShardTask],
                max_attempts: int, now: float) -> None:
        rows = [{"job_id": job_id, "kind": t.kind, "phase": t.phase, "shard": t.shard, "source": source,
                 "payload": json.dumps(t.payload), "status": _QUEUED, "attempt": 0, "max_attempts": max_attempts,
                 "created_at": now} for t in tasks]
        if rows:
            conn.execute(self._tasks.insert(), rows)

    # -- a worker's side -------------------------------------------------------------------------------
    def claim(self, worker_id: str, host: str, *, job_id: str | None = None,
              live_within_s: float | None = None) -> Task | None:
        """Atomically claim the task a worker should run next (of ``job_id`` only, when given); None when none may
        start.

        Claimable: queued, its job running, every task of a lower phase of its job succeeded, and not a task
        ``host`` failed while a worker on another host that heartbeated within ``live_within_s`` has not (or
        before its back-off: ``service.store.host_faults``). Tasks whose source this host has read before (a task
        of the same source succeeded here) come first, then the oldest. The claim of a retry of a host fault
        writes a ``retry`` event naming the host it went to.
        """
        t, j = self._tasks, self._jobs
        earlier, cached = t.alias("earlier"), t.alias("cached")
        job_running = sa.select(j.c.id).where(j.c.id == t.c.job_id, j.c.status == JobStatus.RUNNING.value).exists()
        blocked = sa.select(earlier.c.seq).where(earlier.c.job_id == t.c.job_id, earlier.c.phase < t.c.phase,
                                                 earlier.c.status != TaskStatus.SUCCEEDED.value).exists()
        here = sa.select(cached.c.seq).where(cached.c.source == t.c.source, cached.c.host == host,
                                             cached.c.status == TaskStatus.SUCCEEDED.value).exists()
        only = [t.c.job_id == job_id] if job_id is not None else []
        with self._engine.begin() as conn:
            others = live_hosts(conn, self._workers, self._db_now, live_within_s) - {host} \
                if live_within_s is not None else set()
            pick = (sa.select(t.c.seq)
                    .where(t.c.status == _QUEUED, job_running, ~blocked, ~avoided_by(t, host, others, self._db_now),
                           *only)
                    .order_by(sa.case((here, 0), else_=1), t.c.seq).limit(1)
                    .with_for_update(skip_locked=True).scalar_subquery())
            stmt = (sa.update(t).where(t.c.seq == pick, t.c.status == _QUEUED)
                    .values(status=_RUNNING, attempt=t.c.attempt + 1, worker_id=worker_id, host=host,
                            heartbeat_at=self._db_now, started_at=time.time(), error_code=None, error_message=None)
                    .returning(*t.c))
            row = conn.execute(stmt).mappings().first()
            if row is not None and row["failed_hosts"]:
                task = _task(row)
                self._events.append(conn, task.job_id, "retry", {
                    "message": f"{task.name} runs again (attempt {task.attempt} of {task.max_attempts}) on another "
                               "host than the one that failed it", "shard": task.shard, "kind": task.kind,
                    "host": public_host_name(host), "failed_hosts": [public_host_name(h) for h in
                                                                     json.loads(row["failed_hosts"])]}, time.time())
        return None if row is None else _task(row)

    def heartbeat(self, task: Task, worker_id: str) -> JobStatus | None:
        """Refresh the task's heartbeat; returns its job's status, or None when the task is no longer this
        worker's attempt (it was reaped and requeued, or dropped)."""
        t = self._tasks
        with self._engine.begin() as conn:
            owned = conn.execute(sa.update(t).where(*self._owned(task, worker_id))
                                 .values(heartbeat_at=self._db_now)).rowcount
            if not owned:
                return None
            status = conn.execute(sa.select(self._jobs.c.status).where(self._jobs.c.id == task.job_id)).scalar()
        return None if status is None else JobStatus(status)

    def succeed(self, task: Task, worker_id: str, result: Mapping[str, Any], *,
                new_tasks: Iterable[Mapping[str, Any]] = ()) -> bool:
        """Record the task's result (and add the tasks its result names, in their wire form); False when it is no
        longer this worker's. Updates the job's progress and writes a progress event in the same transaction."""
        with self._engine.begin() as conn:
            return self.succeed_in(conn, task, worker_id, result, new_tasks=new_tasks)

    def succeed_in(self, conn: sa.Connection, task: Task, worker_id: str, result: Mapping[str, Any], *,
                   new_tasks: Iterable[Mapping[str, Any]] = ()) -> bool:
        """:meth:`succeed` inside the caller's transaction (the job's success and its finishing task's are one
        write: nobody reads the job finished with that task still running)."""
        now, added = time.time(), [ShardTask.from_dict(new) for new in new_tasks]
        done = conn.execute(sa.update(self._tasks).where(*self._owned(task, worker_id)).values(
            status=TaskStatus.SUCCEEDED.value, result=json.dumps(result), finished_at=now)).rowcount
        if not done:
            return False
        self._insert(conn, task.job_id, task.source, added, task.max_attempts, now)
        self._progress(conn, task.job_id, now)
        return True

    def release(self, task: Task, status: TaskStatus, *, worker_id: str | None = None, stale_for_s: float | None = None,
                count_attempt: bool = True, error: tuple[str, str] | None = None) -> bool:
        """Move a running task to ``status`` (queued: another attempt; failed; cancelled) as its worker, or, with
        ``stale_for_s``, as a reaper that finds it silent that long. False when it changed meanwhile."""
        t = self._tasks
        where = self._owned(task, worker_id) if worker_id is not None else [
            t.c.seq == task.seq, t.c.status == _RUNNING, t.c.attempt == task.attempt]
        if stale_for_s is not None:
            where.append(t.c.heartbeat_at < self._db_now - stale_for_s)
        values: dict[str, Any] = {"status": status.value}
        if status is TaskStatus.QUEUED:
            values.update(worker_id=None, attempt=task.attempt if count_attempt else task.attempt - 1)
        else:
            values["finished_at"] = time.time()
        if error is not None:
            values.update(error_code=error[0], error_message=error[1])
        with self._engine.begin() as conn:
            return conn.execute(sa.update(t).where(*where).values(**values)).rowcount == 1

    def release_host_fault(self, task: Task, *, error: tuple[str, str], worker_id: str | None = None,
                           stale_for_s: float | None = None) -> tuple[HostFaultRetry, dict[str, Any]]:
        """Requeue a running task that failed because of its host (``error``: its code and message), as its worker
        or, with ``stale_for_s``, as a reaper; the host is charged with the fault and the retry goes elsewhere
        (``service.store.host_faults``). Returns what it did and, when requeued, its event's data (the hosts)."""
        t = self._tasks
        where = self._owned(task, worker_id) if worker_id is not None else [
            t.c.seq == task.seq, t.c.status == _RUNNING, t.c.attempt == task.attempt]
        if stale_for_s is not None:
            where.append(t.c.heartbeat_at < self._db_now - stale_for_s)
        with self._engine.begin() as conn:
            row = conn.execute(sa.select(t.c.host, t.c.failed_hosts, t.c.host_faults, t.c.max_attempts)
                               .where(*where)).mappings().first()
            if row is None:
                return HostFaultRetry.CHANGED, {}
            fault = charge(row, self._db_now)
            if fault is None:
                return HostFaultRetry.SPENT, {}
            requeued = conn.execute(sa.update(t).where(*where).values(
                status=_QUEUED, worker_id=None, error_code=error[0], error_message=error[1], **fault.values)).rowcount
        return (HostFaultRetry.ELSEWHERE, fault.event) if requeued else (HostFaultRetry.CHANGED, {})

    def _owned(self, task: Task, worker_id: str) -> list[sa.ColumnElement[bool]]:
        t = self._tasks
        return [t.c.seq == task.seq, t.c.worker_id == worker_id, t.c.attempt == task.attempt, t.c.status == _RUNNING]

    # -- reading ---------------------------------------------------------------------------------------
    def of_job(self, job_id: str, *, kind: str | None = None) -> list[Task]:
        """The job's tasks (of one ``kind``), in the order they were stored."""
        query = sa.select(self._tasks).where(self._tasks.c.job_id == job_id).order_by(self._tasks.c.seq)
        if kind is not None:
            query = query.where(self._tasks.c.kind == kind)
        with self._engine.connect() as conn:
            return [_task(row) for row in conn.execute(query).mappings()]

    def listing(self, job_id: str) -> list[dict[str, Any]]:
        """The job's tasks as ``GET /v1/jobs/{id}/tasks`` shows them, in the order they were stored: every column
        but the payload and result (worker ids and hosts as stored)."""
        t = self._tasks
        columns = [t.c.kind, t.c.shard, t.c.status, t.c.attempt, t.c.max_attempts, t.c.worker_id, t.c.host,
                   t.c.created_at, t.c.started_at, t.c.finished_at, t.c.error_code, t.c.error_message]
        with self._engine.connect() as conn:
            return [dict(row) for row in conn.execute(sa.select(*columns).where(t.c.job_id == job_id)
                                                      .order_by(t.c.seq)).mappings()]

    def results(self, job_id: str, kind: str) -> list[dict[str, Any]]:
        """The results of the job's succeeded tasks of ``kind``, in the order they were stored."""
        return [dict(task.result or {}) for task in self.of_job(job_id, kind=kind)
                if task.status is TaskStatus.SUCCEEDED]

    def stale(self, timeout_s: float) -> list[Task]:
        """Running tasks whose worker has not heartbeaten for ``timeout_s`` seconds (database clock)."""
        t = self._tasks
        with self._engine.connect() as conn:
            rows = conn.execute(sa.select(t).where(t.c.status == _RUNNING,
                                                   t.c.heartbeat_at < self._db_now - timeout_s)).mappings().all()
        return [_task(row) for row in rows]

    def settling(self) -> list[str]:
        """Split jobs that are cancelling, or jobs finished with tasks still queued: the reaper settles them (a
        cancelling calibrated job is its own worker's to settle)."""
        t, j = self._tasks, self._jobs
        active = sa.select(t.c.seq).where(t.c.job_id == j.c.id, t.c.status.in_((_RUNNING, _QUEUED))).exists()
        finished = j.c.status.in_([s.value for s in JobStatus if s.is_finished])
        query = sa.select(j.c.id).where(
            sa.or_(sa.and_(j.c.status == JobStatus.CANCELLING.value, self.has_tasks()), sa.and_(finished, active)))
        with self._engine.connect() as conn:
            return list(conn.execute(query).scalars())

    def drop(self, job_id: str) -> int:
        """Mark the job's queued tasks cancelled; returns how many of its tasks still run."""
        t = self._tasks
        with self._engine.begin() as conn:
            conn.execute(sa.update(t).where(t.c.job_id == job_id, t.c.status == _QUEUED).values(
                status=TaskStatus.CANCELLED.value, finished_at=time.time()))
            return conn.execute(sa.select(sa.func.count()).where(t.c.job_id == job_id,
                                                                  t.c.status == _RUNNING)).scalar_one()

    def has_tasks(self) -> sa.ColumnElement[bool]:
        """``EXISTS`` a task of the jobs row in the enclosing query, i.e. the job is split into tasks (for
        ``JobStore.find_stale``); a calibrated job's serving shard tasks do not count: its worker heartbeats it."""
        t = self._tasks
        return sa.select(t.c.seq).where(t.c.job_id == self._jobs.c.id, t.c.kind.notin_(_WORKER_KEPT_KINDS)).exists()

    def is_split(self, job_id: str) -> bool:
        """Whether the job runs as tasks (not a calibrated job whose worker only hands out its serving shards)."""
        t = self._tasks
        with self._engine.connect() as conn:
            return conn.execute(sa.select(t.c.seq).where(t.c.job_id == job_id, t.c.kind.notin_(_WORKER_KEPT_KINDS))
                                .limit(1)).first() is not None

    def delete(self, conn: sa.Connection, job_id: str) -> None:
        conn.execute(sa.delete(self._tasks).where(self._tasks.c.job_id == job_id))

    def _progress(self, conn: sa.Connection, job_id: str, now: float) -> None:
        """Set the job's stage and shards done / total from its tasks; a progress (or stage) event says so."""
        t = self._tasks
        counts: dict[str, list[int]] = {}
        for kind, status, n in conn.execute(sa.select(t.c.kind, t.c.status, sa.func.count())
                                            .where(t.c.job_id == job_id, t.c.status != TaskStatus.CANCELLED.value)
                                            .group_by(t.c.kind, t.c.status)):
            entry = counts.setdefault(kind, [0, 0])
            entry[1] += n
            entry[0] += n if status == TaskStatus.SUCCEEDED.value else 0
        pending = [kind for kind in _STAGE_OF if kind in counts and counts[kind][0] < counts[kind][1]]
        stage = _STAGE_OF[pending[0]] if pending else Stage.EXPORT
        kinds = [kind for kind, of in _STAGE_OF.items() if of is stage and kind in counts]
        done, total = (sum(counts[kind][i] for kind in kinds) for i in (0, 1))
        shards_done, shards_total = (sum(counts.get(kind, [0, 0])[i] for kind in _SHARD_KINDS) for i in (0, 1))
        j = self._jobs
        row = conn.execute(sa.select(j.c.stage, j.c.status).where(j.c.id == job_id)).first()
        if row is None or row.status != JobStatus.RUNNING.value:
            return  # finished (the finish task records its job's success first): its last event is its status
        previous = row.stage
        conn.execute(sa.update(j).where(j.c.id == job_id, j.c.status == JobStatus.RUNNING.value).values(
            stage=stage.value, stage_done=done, stage_total=total))
        written = {"shards_done": shards_done, "shards_total": shards_total, **self._bytes_written(conn, job_id)}
        if previous != stage.value:
            ended = [kind for kind, of in _STAGE_OF.items() if of.value == previous and kind in counts]
            if ended:  # the stage just ended, at its full count: the CLI's bar of it ends so too
                tasks = sum(counts[kind][1] for kind in ended)
                self._events.append(conn, job_id, "progress", progress_event(
                    previous, tasks, tasks, Unit.TASK, **written), now)
            self._events.append(conn, job_id, "stage", {"stage": stage.value, "tasks": total}, now)
        self._events.append(conn, job_id, "progress", progress_event(stage.value, done, total, Unit.TASK, **written),
                            now)

    def _bytes_written(self, conn: sa.Connection, job_id: str) -> dict[str, int]:
        """``bytes_done`` / ``bytes_total``: the tensor bytes of the job's written shards, of all its shards, as its
        plan put them in each shard task (``planned_bytes``); none when a shard task has no such figure."""
        t = self._tasks
        rows = conn.execute(sa.select(t.c.status, t.c.payload).where(
            t.c.job_id == job_id, t.c.kind.in_(_SHARD_KINDS), t.c.status != TaskStatus.CANCELLED.value)).all()
        planned = [(status, json.loads(payload).get("planned_bytes")) for status, payload in rows]
        if not planned or any(size is None for _, size in planned):
            return {}
        return {"bytes_done": sum(size for status, size in planned if status == TaskStatus.SUCCEEDED.value),
                "bytes_total": sum(size for _, size in planned)}


def _task(row: Mapping[str, Any]) -> Task:
    return Task(seq=row["seq"], job_id=row["job_id"], kind=row["kind"], phase=row["phase"], shard=row["shard"],
                source=row["source"], payload=json.loads(row["payload"]), status=TaskStatus(row["status"]),
                attempt=row["attempt"], max_attempts=row["max_attempts"], worker_id=row["worker_id"],
                host=row["host"], result=json.loads(row["result"]) if row["result"] else None)
