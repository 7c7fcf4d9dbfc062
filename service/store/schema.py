"""The job store's tables and the dialect-specific pieces: engine set-up and the database clock.

Kept apart from the queries so that what is stored, and how SQLite and PostgreSQL differ, reads in one place.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlalchemy.engine import Engine, make_url

from service.config import make_private_dir, make_private_file
from service.jobs import JobStatus

__all__ = [
    "ACTIVE_STATUSES", "StoreTimeouts", "Tables", "brief", "create_schema", "db_now",
    "lock_refused", "make_engine", "tables",
]

# a job in one of these has an owning worker whose heartbeats keep it alive
ACTIVE_STATUSES = (JobStatus.RUNNING.value, JobStatus.CANCELLING.value)


class Tables(NamedTuple):
    metadata: sa.MetaData
    jobs: sa.Table
    events: sa.Table
    workers: sa.Table
    durations: sa.Table
    tasks: sa.Table


def tables(prefix: str) -> Tables:
    """The metadata and the jobs, job_events, workers, stage_durations and job_tasks tables, each name after
    ``prefix``."""
    md = sa.MetaData()
    jobs = sa.Table(
        f"{prefix}jobs", md,
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(32), nullable=False, unique=True),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("request", sa.JSON, nullable=False),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("idempotency_key", sa.String(200), unique=True),
        sa.Column("attempt", sa.Integer, nullable=False, default=0),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("stage", sa.String(16)),
        sa.Column("stage_done", sa.Integer, nullable=False, default=0),
        sa.Column("stage_total", sa.Integer, nullable=False, default=0),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("updated_at", sa.Double, nullable=False),
        sa.Column("started_at", sa.Double),
        sa.Column("finished_at", sa.Double),
        sa.Column("heartbeat_at", sa.Double),
        sa.Column("worker_id", sa.String(200)),
        sa.Column("error_code", sa.String(64)),
        sa.Column("error_message", sa.Text),
        sa.Column("artifacts", sa.JSON),
        sa.Column("owner", sa.String(64), index=True),
        *_host_fault_columns(),
        sa.Column("host", sa.String(255)),  # the host of its current (or last) attempt: a fault is charged to it
        sqlite_autoincrement=True,  # never reuse a seq: cursors stay valid across deletions
    )
    events = sa.Table(
        f"{prefix}job_events", md,
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), nullable=False, index=True),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
        sqlite_autoincrement=True,
    )
    workers = sa.Table(
        f"{prefix}workers", md,
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Double, nullable=False),
        sa.Column("heartbeat_at", sa.Double, nullable=False),
        sa.Column("job_id", sa.String(32)),
        sa.Column("host", sa.String(255)),  # its host's name in failed_hosts (service.store.host_faults)
    )
    durations = sa.Table(
        f"{prefix}stage_durations", md,
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("stage", sa.String(16), nullable=False),
        sa.Column("seconds", sa.Double, nullable=False),
    )
    # A job split into tasks (a requantize job): each row is claimed, heartbeated, retried and reaped on its own.
    # payload and result are JSON text written by the store, so key order (and the report's bytes) survive.
    tasks = sa.Table(
        f"{prefix}job_tasks", md,
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), nullable=False, index=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("phase", sa.Integer, nullable=False),
        sa.Column("shard", sa.String(1024)),
        sa.Column("source", sa.String(1024), nullable=False, index=True),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("attempt", sa.Integer, nullable=False, default=0),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("worker_id", sa.String(200)),
        sa.Column("host", sa.String(255)),  # the host that last claimed it: it holds the source in its cache
        sa.Column("heartbeat_at", sa.Double),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("started_at", sa.Double),
        sa.Column("finished_at", sa.Double),
        sa.Column("result", sa.Text),
        sa.Column("error_code", sa.String(64)),
        sa.Column("error_message", sa.Text),
        *_host_fault_columns(),
        sqlite_autoincrement=True,
    )
    return Tables(md, jobs, events, workers, durations, tasks)


def _host_fault_columns() -> list[sa.Column]:
    """What a retry of a host fault needs (``service.store.host_faults``): the hosts that failed the row (a JSON
    list of names), how many host faults it has had, and when one of those hosts may take it back."""
    return [sa.Column("failed_hosts", sa.Text), sa.Column("host_faults", sa.Integer, nullable=False, default=0,
                                                          server_default="0"),
            sa.Column("retry_after", sa.Double)]


def create_schema(engine: Engine, t: Tables, prefix: str) -> None:
    """Bring the database to the newest schema (service.store.migrations; idempotent).

    On PostgreSQL this runs in one transaction under an advisory lock named after the tables: processes that
    start at once against a fresh database (an API, its workers) take turns, where each would otherwise see the
    tables missing and all but one would crash creating them. SQLite has no such lock and its driver runs DDL
    outside the transaction: a start that loses the race to another (a table or version row already there) runs
    the upgrade again and finds nothing left to do.
    """
    from service.store.migrations import upgrade_schema  # alembic: only a process that opens a store needs it

    for attempt in range(3):
        try:
            with engine.begin() as conn:
                if engine.dialect.name == "postgresql":
                    lock = sa.func.hashtext(f"fp8forge-schema:{t.jobs.name}")
                    conn.execute(sa.select(sa.func.pg_advisory_xact_lock(lock)))
                upgrade_schema(conn, prefix)
            return
        except sa.exc.DBAPIError:
            if engine.dialect.name != "sqlite" or attempt == 2:
                raise


def db_now(engine: Engine) -> sa.ColumnElement[float]:
    """Seconds since the epoch by the database server's clock.

    Heartbeats are written and judged stale by this one clock, so workers and reapers on hosts whose clocks
    disagree still agree on how long a job has been silent. SQLite's ``CURRENT_TIMESTAMP`` has one-second
    resolution and is a string, hence ``julianday`` (milliseconds); PostgreSQL's ``clock_timestamp()`` is the
    wall clock at the moment of the statement.
    """
    if engine.dialect.name == "sqlite":
        return sa.literal_column("((julianday('now') - 2440587.5) * 86400.0)", sa.Double)
    return sa.cast(sa.extract("epoch", sa.func.clock_timestamp()), sa.Double)


def request_without_texts(engine: Engine, request: sa.Column) -> sa.ColumnElement[Any]:
    """A job's ``request`` without ``calibration.texts``, left out by the database itself: a page of jobs then
    never loads their texts (up to a request body each, FP8FORGE_MAX_BODY_BYTES)."""
    if engine.dialect.name == "sqlite":
        return sa.func.json_remove(request, "$.calibration.texts", type_=sa.JSON)
    from sqlalchemy.dialects.postgresql import ARRAY, JSONB

    path = sa.cast(sa.literal("{calibration,texts}"), ARRAY(sa.Text))
    return sa.type_coerce(sa.cast(request, JSONB).op("#-")(path), sa.JSON)


@dataclass(frozen=True, kw_only=True)
class StoreTimeouts:
    """How long the store's statements may wait, so that no process waits forever on another.

    Args:
        lock_s: the longest a statement waits for a lock another transaction holds (PostgreSQL ``lock_timeout``,
            SQLite's busy timeout); then it fails, and its caller retries or answers "not now".
        statement_s: PostgreSQL ``statement_timeout``: the longest one statement may run.
        idle_in_transaction_s: PostgreSQL ``idle_in_transaction_session_timeout``: a session that stays idle inside
            a transaction this long (its process was stopped or hangs) is ended by the server, which releases its
            locks.
    """

    lock_s: float = 10.0
    statement_s: float = 60.0
    idle_in_transaction_s: float = 60.0

    def __post_init__(self) -> None:
        for f in fields(self):
            if not getattr(self, f.name) > 0:
                raise ValueError(f"{f.name} must be a positive number of seconds, not {getattr(self, f.name)!r}")

    def session_options(self) -> str:
        """The libpq ``options`` that set these timeouts on every PostgreSQL session (in milliseconds)."""
        settings = {"lock_timeout": self.lock_s, "statement_timeout": self.statement_s,
                    "idle_in_transaction_session_timeout": self.idle_in_transaction_s}
        return " ".join(f"-c {name}={max(1, round(seconds * 1000))}" for name, seconds in settings.items())


_LOCK_REFUSED_SQLSTATES = {"55P03", "57014"}  # lock_not_available (lock_timeout, NOWAIT), query_canceled
_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6


def lock_refused(exc: BaseException) -> bool:
    """True when a statement failed because another transaction held what it needed past the lock timeout (or a
    NOWAIT lock was taken), or it ran past the statement timeout: "not now", not a broken store."""
    orig = getattr(exc, "orig", exc)
    if getattr(orig, "sqlstate", None) in _LOCK_REFUSED_SQLSTATES:
        return True
    code = getattr(orig, "sqlite_errorcode", None)  # an extended code: the primary one is its low byte
    return code is not None and code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED)


def brief(exc: BaseException) -> str:
    """A database error's own first line, without SQLAlchemy's statement and background link: for one log line."""
    lines = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _private_database(database: Path) -> None:
    """The SQLite file (and the directory it is created in) readable by this user alone: it holds every tenant's
    jobs. SQLite gives the -wal and -shm files the database's mode; ones left by an older, looser start follow."""
    make_private_dir(database.parent)
    make_private_file(database)
    for side in (database.with_name(f"{database.name}-wal"), database.with_name(f"{database.name}-shm")):
        if side.exists():
            make_private_file(side)


def make_engine(url: str, timeouts: StoreTimeouts | None = None) -> Engine:
    """An engine for ``url``: connect and lock timeouts for a server, WAL and a busy timeout for a SQLite file."""
    timeouts = timeouts or StoreTimeouts()
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        # a database host that stops answering must fail a call in seconds, not hang a worker's heartbeats
        connect_args: dict[str, Any] = {"connect_timeout": 10} if "connect_timeout" not in parsed.query else {}
        # options given in the URL come last, so they win over these defaults
        connect_args["options"] = " ".join([timeouts.session_options(), *_as_list(parsed.query.get("options"))])
        return sa.create_engine(url, pool_pre_ping=True, connect_args=connect_args)
    if parsed.database and parsed.database != ":memory:" and not parsed.database.startswith("file:"):
        _private_database(Path(parsed.database))
    # As many pooled connections as the API runs threads (anyio's default limiter: 40): with SQLAlchemy's default 5
    # (+10 overflow) the threads beyond fifteen queued for a connection, and every read waited on them. The
    # overflow covers the rest: the event loop's inline reads (JobStore.reads_inline) and the reaper's thread, so a
    # read on the loop never waits for a connection.
    engine = sa.create_engine(url, connect_args={"timeout": timeouts.lock_s, "check_same_thread": False},
                              pool_size=40)
    busy_ms = max(1, round(timeouts.lock_s * 1000))

    @sa.event.listens_for(engine, "connect")
    def _pragmas(dbapi_conn: Any, _: Any) -> None:
        cur = dbapi_conn.cursor()
        # WAL lets the API read while a worker writes; busy_timeout makes writers queue, not fail, for as long as
        # the lock timeout (a process stopped inside a write transaction holds the one write lock)
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute(f"PRAGMA busy_timeout={busy_ms}")
        cur.close()

    return engine


def _as_list(value: str | tuple[str, ...] | None) -> list[str]:
    return [] if value is None else [value] if isinstance(value, str) else list(value)

