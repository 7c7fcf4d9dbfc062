"""The durable job store: SQLite (WAL) by default, PostgreSQL through the same SQLAlchemy Core code.

Every status change is a compare-and-set ``UPDATE ... WHERE status = <seen>`` checked against the one
transition table, so concurrent API processes, workers and reapers never overwrite each other. A claim is
one ``UPDATE ... WHERE seq = (SELECT ... FOR UPDATE SKIP LOCKED) RETURNING``: atomic on both databases.

This class holds job queries and status transitions; the tables and dialect helpers live in
``service.store.schema``, event logs in ``service.store.events`` (``JobStore.events``), worker heartbeats and
stage timings in ``service.store.workers`` (``JobStore.workers``, ``JobStore.timings``), the tasks of a job split
into tasks in ``service.store.tasks`` (``JobStore.tasks``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import uuid
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError, IntegrityError

from service.errors import IdempotencyConflict, InvalidRequest, InvalidTransition, JobNotFound, TooManyJobs
from service.jobs import Job, JobStatus, Stage, public_worker_name, transition
from service.store.events import EventLog
from service.store.host_faults import HostFault, avoided_by, charge, live_hosts, public_host_name
from service.store.probe import Probe
from service.store.schema import (
    ACTIVE_STATUSES,
    StoreTimeouts,
    brief,
    create_schema,
    db_now,
    lock_refused,
    make_engine,
    request_without_texts,
    tables,
)
from service.store.tasks import TaskQueue
from service.store.workers import StageTimings, WorkerRegistry

if TYPE_CHECKING:
    from service.config import Settings

__all__ = ["JobStore", "JobLost", "JobBusy"]

logger = logging.getLogger(__name__)


class JobLost(Exception):
    """A worker wrote to a job it no longer owns (it was requeued and maybe claimed elsewhere)."""


class JobBusy(Exception):
    """Another transaction holds the job's row (a process stopped inside its write, say): not now, try later."""


class JobStore:
    """Jobs, their event logs, worker heartbeats and stage timings in one SQL database.

    Args:
        url: SQLAlchemy URL (``sqlite:///path`` or ``postgresql+psycopg://...``).
        table_prefix: prepended to every table name, so several stores can share one database.
        timeouts: how long statements may wait for locks and run (``StoreTimeouts()``'s defaults when omitted).
    """

    def __init__(self, url: str, *, table_prefix: str = "", timeouts: StoreTimeouts | None = None) -> None:
        self.engine = make_engine(url, timeouts)
        self.tables = tables(table_prefix)
        create_schema(self.engine, self.tables, table_prefix)
        self._prefix = table_prefix
        self._jobs = self.tables.jobs
        # built once: a status poll runs it on every request, and building the SELECT is a good part of its cost
        self._by_id = sa.select(self._jobs).where(self._jobs.c.id == sa.bindparam("job_id"))
        self._db_now = db_now(self.engine)
        # A SQLite file answers a primary-key read in microseconds, and in WAL mode a reader never waits for a
        # writer: the API may run such reads on its event loop instead of paying a threadpool hop (and the GIL
        # hand-offs that come with it) for each. A database server's round trip must stay off the loop.
        self.reads_inline = self.engine.dialect.name == "sqlite"
        self.events = EventLog(self.engine, self.tables)
        self.workers = WorkerRegistry(self.engine, self.tables, self._db_now)
        self.timings = StageTimings(self.engine, self.tables)
        self.tasks = TaskQueue(self.engine, self.tables, self._db_now, self.events)
        self._probe: Probe[int] = Probe("fp8forge-store-probe")

    @classmethod
    def from_settings(cls, settings: Settings) -> JobStore:
        """The store the settings name, with their lock, statement and idle-in-transaction timeouts."""
        return cls(settings.store_url, timeouts=StoreTimeouts(
            lock_s=settings.store_lock_timeout_s, statement_s=settings.store_statement_timeout_s,
            idle_in_transaction_s=settings.store_idle_in_transaction_timeout_s))

    # -- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        self.engine.dispose()

    def drop_all(self) -> None:
        """Drop this store's tables (tests use it to clean up their own prefix)."""
        from service.store.migrations import version_table  # alembic's package: only for the schema's changes

        self.tables.metadata.drop_all(self.engine)
        with self.engine.begin() as conn:
            conn.execute(sa.text(f'DROP TABLE IF EXISTS "{version_table(self._prefix)}"'))
        self.engine.dispose()

    def readiness(self, *, within_s: float, worker_timeout_s: float) -> int | None:
        """The number of live workers, or None when the store did not answer within ``within_s`` seconds.

        A store that hangs (a server that stopped answering, a lock held by a stopped process) makes the answer
        None instead of hanging its caller; while one check hangs no other starts, so probes do not pile up.
        """
        def check() -> int:
            with self.engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
            return len(self.workers.live(worker_timeout_s))

        return self._probe.run(check, within_s)

    # -- jobs --------------------------------------------------------------------------------------
    def create_job(
        self, request: Mapping[str, Any], *, request_hash: str, idempotency_key: str | None = None,
        max_attempts: int = 3, owner: str | None = None, max_queued: int | None = None,
    ) -> tuple[Job, bool]:
        """Store a new queued job; returns ``(job, created)``.

        With an ``idempotency_key`` already used by the same ``owner`` for the same ``request_hash`` the
        existing job is returned with ``created=False``; keys of different owners never meet.

        Raises:
            IdempotencyConflict: the key was used for a different request.
            TooManyJobs: ``owner`` already has ``max_queued`` queued jobs.
        """
        now = time.time()
        job_id = uuid.uuid4().hex
        stored_key = _scoped_key(owner, idempotency_key)
        values = dict(
            id=job_id, status=JobStatus.QUEUED.value, request=dict(request), request_hash=request_hash,
            idempotency_key=stored_key, attempt=0, max_attempts=max_attempts, stage_done=0,
            stage_total=0, created_at=now, updated_at=now, owner=owner,
        )
        try:
            with self.engine.begin() as conn:
                if owner is not None and max_queued is not None:
                    inserted = self._insert_within_limit(conn, values, owner, max_queued)
                else:
                    conn.execute(self._jobs.insert().values(**values))  # raises, or inserted the row
                    inserted = True
                if not inserted:
                    existing = self._by_key(stored_key) if stored_key else None
                    if existing is None:
                        raise TooManyJobs(
                            f"this key already has {max_queued} queued jobs, the most it may have; wait for some "
                            "to start, or cancel some", headers={"Retry-After": "30"})
                    return self._same_request(existing, request_hash), False
                self.events.append(conn, job_id, "status", {"status": JobStatus.QUEUED.value}, now)
        except IntegrityError:
            if stored_key is None:
                raise
            row = self._by_key(stored_key)
            if row is None:  # the holder was deleted in between: the key is free again
                return self.create_job(request, request_hash=request_hash, idempotency_key=idempotency_key,
                                       max_attempts=max_attempts, owner=owner, max_queued=max_queued)
            return self._same_request(row, request_hash), False
        return self.get_job(job_id), True

    def _insert_within_limit(self, conn: sa.Connection, values: dict[str, Any], owner: str, limit: int) -> bool:
        """Insert the job only while ``owner`` has fewer than ``limit`` queued jobs, in one statement."""
        c = self._jobs.c
        if self.engine.dialect.name == "postgresql":  # serialise one owner's submissions: count, then insert
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtext(f"fp8forge-owner:{owner}"))))
        queued = sa.select(sa.func.count()).where(c.owner == owner, c.status == JobStatus.QUEUED.value) \
            .scalar_subquery()
        row = sa.select(*(sa.literal(v, c[k].type) for k, v in values.items())).where(queued < limit)
        insert = self._jobs.insert().from_select(list(values), row).returning(c.seq)
        return conn.execute(insert).first() is not None

    def _by_key(self, stored_key: str) -> Mapping[str, Any] | None:
        with self.engine.connect() as conn:
            return conn.execute(
                sa.select(self._jobs).where(self._jobs.c.idempotency_key == stored_key)).mappings().first()

    def _same_request(self, row: Mapping[str, Any], request_hash: str) -> Job:
        if row["request_hash"] != request_hash:
            raise IdempotencyConflict(
                "this Idempotency-Key was already used for a different request body; use a new key",
                field="Idempotency-Key",
            )
        return self._job(row)

    def get_job(self, job_id: str) -> Job:
        """Raises JobNotFound when no job has this id."""
        with self.engine.connect() as conn:
            row = conn.execute(self._by_id, {"job_id": job_id}).first()  # .mappings() cost ~30 us more
        if row is None:
            raise JobNotFound(f"no job with id {job_id!r}")
        return self._job(row._mapping)

    def list_jobs(
        self, *, status: JobStatus | None = None, limit: int = 50, cursor: str | None = None,
        owner: str | None = None,
    ) -> tuple[list[Job], str | None]:
        """Newest first (only ``owner``'s when given); returns the page and the next page's cursor (None: last).

        Each job's ``request`` comes without its ``calibration.texts``: a page may hold 200 jobs, and each one's
        texts may be a megabyte; :meth:`get_job` has them.
        """
        columns = [c for c in self._jobs.c if c.name != "request"]
        columns.append(request_without_texts(self.engine, self._jobs.c.request).label("request"))
        query = sa.select(*columns).order_by(self._jobs.c.seq.desc()).limit(limit + 1)
        if owner is not None:
            query = query.where(self._jobs.c.owner == owner)
        if status is not None:
            query = query.where(self._jobs.c.status == status.value)
        if cursor is not None:
            if not re.fullmatch(r"[0-9]{1,18}", cursor):  # str.isdigit() accepts "²"; 19 digits overflow
                raise InvalidRequest("cursor must be a value returned as next_cursor", field="cursor")
            query = query.where(self._jobs.c.seq < int(cursor))
        with self.engine.connect() as conn:
            rows = conn.execute(query).all()
        page = [self._job(r._mapping) for r in rows[:limit]]
        return page, (str(page[-1].seq) if len(rows) > limit else None)

    def count_by_status(self) -> dict[JobStatus, int]:
        counts = dict.fromkeys(JobStatus, 0)
        with self.engine.connect() as conn:
            for status, n in conn.execute(
                sa.select(self._jobs.c.status, sa.func.count()).group_by(self._jobs.c.status)
            ):
                counts[JobStatus(status)] = n
        return counts

    def claim_next(self, worker_id: str, *, host: str | None = None, live_within_s: float | None = None,
                   max_running_per_owner: int | None = None, job_id: str | None = None) -> Job | None:
        """Atomically move the oldest queued job to running for ``worker_id`` on ``host``; None when none is queued.

        With ``max_running_per_owner``, jobs of an owner who already has that many running wait their turn. On
        PostgreSQL such claims take turns on an advisory lock, so two workers claiming at the same instant cannot
        each count the other's job as not yet running (SQLite runs one writer at a time anyway). A job ``host``
        failed is left to workers on other hosts that heartbeated within ``live_within_s``, as tasks are
        (``service.store.host_faults``); the claim's event names the host.
        """
        transition(JobStatus.QUEUED, JobStatus.RUNNING)
        now = time.time()
        c = self._jobs.c
        claimable = sa.select(c.seq).where(c.status == JobStatus.QUEUED.value)
        if job_id is not None:  # an executor's allocation made for this one job (service.executors)
            claimable = claimable.where(c.id == job_id)
        if max_running_per_owner is not None:
            busy = sa.select(c.owner).where(c.status.in_(ACTIVE_STATUSES), c.owner.is_not(None)) \
                .group_by(c.owner).having(sa.func.count() >= max_running_per_owner)
            claimable = claimable.where(sa.or_(c.owner.is_(None), c.owner.not_in(busy)))
        try:
            with self.engine.begin() as conn:
                if max_running_per_owner is not None and self.engine.dialect.name == "postgresql":
                    conn.execute(sa.select(
                        sa.func.pg_advisory_xact_lock(sa.func.hashtext(f"fp8forge-claim:{self._jobs}"))))
                if host is not None:
                    others = live_hosts(conn, self.tables.workers, self._db_now, live_within_s) - {host} \
                        if live_within_s is not None else set()
                    claimable = claimable.where(~avoided_by(self._jobs, host, others, self._db_now))
                oldest = claimable.order_by(c.seq).limit(1).with_for_update(skip_locked=True).scalar_subquery()
                row = conn.execute(
                    sa.update(self._jobs).where(c.seq == oldest, c.status == JobStatus.QUEUED.value)
                    .values(status=JobStatus.RUNNING.value, attempt=c.attempt + 1, worker_id=worker_id, host=host,
                            started_at=now, heartbeat_at=self._db_now, updated_at=now, stage=None, stage_done=0,
                            stage_total=0, error_code=None, error_message=None)
                    .returning(*self._jobs.c)).mappings().first()
                if row is None:
                    return None
                claimed = {"status": JobStatus.RUNNING.value, "attempt": row["attempt"],
                           "worker": public_worker_name(worker_id)}
                if host is not None:  # where this attempt runs: after a host fault, another host than the last
                    claimed["host"] = public_host_name(host)
                self.events.append(conn, row["id"], "status", claimed, now)
        except DBAPIError as exc:
            if not lock_refused(exc):
                raise
            # another claimer holds the claim turn past the lock timeout (stopped inside its claim): not now
            logger.warning("claim skipped: the job store is busy (%s)", brief(exc))
            return None
        return self._job(row)

    def set_status(
        self, job_id: str, target: JobStatus, *, owner: str | None = None, owner_attempt: int | None = None,
        stale_for_s: float | None = None, event: Mapping[str, Any] | None = None,
        before_commit: Callable[[sa.Connection], None] | None = None, **values: Any,
    ) -> Job:
        """Change a job's status through the transition table (compare-and-set against concurrent writers).

        Args:
            owner: when given, the write only happens while this worker still owns the job (running or
                cancelling, and ``owner_attempt`` is its current attempt when that is given too).
            stale_for_s: when given, the write only happens if the last heartbeat is at least this many seconds
                old by the database's clock.
            event: extra data for the ``status`` event written with the change.
            before_commit: called with the transaction's connection once the row has changed, before it commits
                (the row stays locked meanwhile; what it writes on that connection commits with the status); if it
                raises, nothing is written and the exception propagates.
            values: other columns to set (error_code, error_message, artifacts, attempt, ...).

        Raises:
            JobNotFound, InvalidTransition, JobLost (``owner`` no longer owns the job, or the job is not stale),
            JobBusy (``stale_for_s`` given and another transaction holds the job's row: a reaper does not wait).
        """
        for _ in range(10):
            job = self.get_job(job_id)
            if owner is not None and not self._owned(job, owner, owner_attempt):
                raise JobLost(f"job {job_id} is no longer owned by {owner}")
            transition(job.status, target)
            now = time.time()
            if target.is_finished:
                values.setdefault("finished_at", now)
            c = self._jobs.c
            stmt = (
                sa.update(self._jobs)
                .where(c.id == job_id, c.status == job.status.value, c.updated_at == job.updated_at)
                .values(status=target.value, updated_at=now, **values)
            )
            if owner is not None:
                stmt = stmt.where(c.worker_id == owner, c.attempt == job.attempt)
            if stale_for_s is not None:
                stmt = stmt.where(c.heartbeat_at < self._db_now - stale_for_s)
            with self.engine.begin() as conn:
                if stale_for_s is not None:
                    self._lock_or_busy(conn, job_id)
                if conn.execute(stmt).rowcount == 1:
                    self.events.append(conn, job_id, "status", {"status": target.value, **(event or {})}, now)
                    changed = self._get(conn, job_id)
                    if before_commit is not None:
                        before_commit(conn)
                    return changed
                if stale_for_s is not None and self._still_fresh(conn, job_id, stale_for_s):
                    raise JobLost(f"job {job_id} heartbeated again; it is not stale")
        raise InvalidTransition(f"job {job_id} kept changing; try again")

    def _lock_or_busy(self, conn: sa.Connection, job_id: str) -> None:
        """Lock the job's row, or raise JobBusy at once if another transaction holds it (PostgreSQL; SQLite has one
        writer at a time, and its busy timeout bounds the wait)."""
        try:
            conn.execute(sa.select(self._jobs.c.seq).where(self._jobs.c.id == job_id).with_for_update(nowait=True))
        except DBAPIError as exc:
            if lock_refused(exc):
                raise JobBusy(f"job {job_id} is locked by another transaction") from exc
            raise

    @staticmethod
    def _owned(job: Job, owner: str, attempt: int | None) -> bool:
        return (job.worker_id == owner and job.status.value in ACTIVE_STATUSES
                and (attempt is None or job.attempt == attempt))

    def _still_fresh(self, conn: sa.Connection, job_id: str, stale_for_s: float) -> bool:
        return conn.execute(sa.select(sa.literal(1)).where(
            self._jobs.c.id == job_id, self._jobs.c.heartbeat_at >= self._db_now - stale_for_s)).first() is not None

    def heartbeat_job(
        self, job_id: str, worker_id: str, *, attempt: int | None = None, stage: Stage | None = None,
        done: int | None = None, total: int | None = None,
    ) -> JobStatus | None:
        """Refresh the job's heartbeat (and progress); returns its status, or None if the worker lost it."""
        values: dict[str, Any] = {"heartbeat_at": self._db_now}
        if stage is not None:
            values.update(stage=stage.value, stage_done=done or 0, stage_total=total or 0)
        stmt = (
            sa.update(self._jobs)
            .where(self._jobs.c.id == job_id, self._jobs.c.worker_id == worker_id,
                   self._jobs.c.status.in_(ACTIVE_STATUSES))
            .values(**values).returning(self._jobs.c.status)
        )
        if attempt is not None:
            stmt = stmt.where(self._jobs.c.attempt == attempt)
        with self.engine.begin() as conn:
            status = conn.execute(stmt).scalar()
        return JobStatus(status) if status is not None else None

    def host_fault(self, job_id: str) -> HostFault | None:
        """What requeues the job as the retry of a fault of the host of its current attempt (for ``set_status``);
        None when that host is unknown or the job has had its host-fault retries (``service.store.host_faults``)."""
        c = self._jobs.c
        with self.engine.connect() as conn:
            row = conn.execute(sa.select(c.host, c.failed_hosts, c.host_faults, c.max_attempts)
                               .where(c.id == job_id)).mappings().first()
        return None if row is None else charge(row, self._db_now)

    def find_stale(self, timeout_s: float) -> list[Job]:
        """Running or cancelling jobs whose worker has not heartbeaten for ``timeout_s`` seconds (database clock)."""
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(self._jobs).where(
                self._jobs.c.status.in_(ACTIVE_STATUSES), self._jobs.c.heartbeat_at < self._db_now - timeout_s,
                ~self.tasks.has_tasks(),  # a job split into tasks lives by its tasks' heartbeats
            )).mappings().all()
        return [self._job(r) for r in rows]

    def delete_job(self, job_id: str) -> Job:
        """Remove a finished job and its event log.

        Raises:
            JobNotFound; InvalidTransition when the job has not finished (cancel it first).
        """
        job = self.get_job(job_id)
        if not job.status.is_finished:
            raise InvalidTransition(f"job is {job.status.value}; only finished jobs can be deleted, cancel it first")
        with self.engine.begin() as conn:
            deleted = conn.execute(sa.delete(self._jobs).where(
                self._jobs.c.id == job_id, self._jobs.c.status == job.status.value)).rowcount
            self.events.delete(conn, job_id)
            self.tasks.delete(conn, job_id)
        if not deleted:
            raise JobNotFound(f"no job with id {job_id!r}")
        return job

    # -- helpers -----------------------------------------------------------------------------------
    def _get(self, conn: sa.Connection, job_id: str) -> Job:
        return self._job(conn.execute(sa.select(self._jobs).where(self._jobs.c.id == job_id)).mappings().one())

    @staticmethod
    def _job(row: Mapping[str, Any]) -> Job:
        return Job(
            id=row["id"], seq=row["seq"], status=JobStatus(row["status"]), request=row["request"],
            attempt=row["attempt"], max_attempts=row["max_attempts"],
            stage=Stage(row["stage"]) if row["stage"] else None, stage_done=row["stage_done"],
            stage_total=row["stage_total"], created_at=row["created_at"], updated_at=row["updated_at"],
            started_at=row["started_at"], finished_at=row["finished_at"], heartbeat_at=row["heartbeat_at"],
            worker_id=row["worker_id"], error_code=row["error_code"], error_message=row["error_message"],
            artifacts=tuple(row["artifacts"] or ()), idempotency_key=row["idempotency_key"], owner=row["owner"],
        )


def _scoped_key(owner: str | None, idempotency_key: str | None) -> str | None:
    """The stored form of an Idempotency-Key: one owner's keys never collide with (or reveal) another's."""
    if idempotency_key is None or owner is None:
        return idempotency_key
    return "o:" + hashlib.sha256(f"{owner}\0{idempotency_key}".encode()).hexdigest()
