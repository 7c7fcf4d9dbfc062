"""The schema of the release before the migrations: jobs, job_events, workers, stage_durations, job_tasks.

Creates the tables a database lacks, and adds ``jobs.owner`` to one made before owners existed, so a database of
any earlier release is adopted in place.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from service.store.migrations.revision_helpers import add_columns_if_missing, existing_tables, prefix

revision = "0001_release_schema"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    p = prefix()
    md = _release_tables(p)
    md.create_all(op.get_bind(), checkfirst=True)
    if f"{p}jobs" in existing_tables():
        add_columns_if_missing(f"{p}jobs", [sa.Column("owner", sa.String(64))])
        op.execute(sa.text(f'CREATE INDEX IF NOT EXISTS "ix_{p}jobs_owner" ON "{p}jobs" ("owner")'))


def _release_tables(p: str) -> sa.MetaData:
    md = sa.MetaData()
    sa.Table(
        f"{p}jobs", md,
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(32), nullable=False, unique=True),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("request", sa.JSON, nullable=False),
        sa.Column("request_hash", sa.String(64), nullable=False),
        sa.Column("idempotency_key", sa.String(200), unique=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("stage", sa.String(16)),
        sa.Column("stage_done", sa.Integer, nullable=False),
        sa.Column("stage_total", sa.Integer, nullable=False),
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
        sqlite_autoincrement=True,
    )
    sa.Table(
        f"{p}job_events", md,
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), nullable=False, index=True),
        sa.Column("at", sa.Double, nullable=False),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("data", sa.JSON, nullable=False),
        sqlite_autoincrement=True,
    )
    sa.Table(
        f"{p}workers", md,
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("hostname", sa.String(255), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", sa.Double, nullable=False),
        sa.Column("heartbeat_at", sa.Double, nullable=False),
        sa.Column("job_id", sa.String(32)),
    )
    sa.Table(
        f"{p}stage_durations", md,
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), nullable=False),
        sa.Column("stage", sa.String(16), nullable=False),
        sa.Column("seconds", sa.Double, nullable=False),
    )
    sa.Table(
        f"{p}job_tasks", md,
        sa.Column("seq", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), nullable=False, index=True),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("phase", sa.Integer, nullable=False),
        sa.Column("shard", sa.String(1024)),
        sa.Column("source", sa.String(1024), nullable=False, index=True),
        sa.Column("payload", sa.Text, nullable=False),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("attempt", sa.Integer, nullable=False),
        sa.Column("max_attempts", sa.Integer, nullable=False),
        sa.Column("worker_id", sa.String(200)),
        sa.Column("host", sa.String(255)),
        sa.Column("heartbeat_at", sa.Double),
        sa.Column("created_at", sa.Double, nullable=False),
        sa.Column("started_at", sa.Double),
        sa.Column("finished_at", sa.Double),
        sa.Column("result", sa.Text),
        sa.Column("error_code", sa.String(64)),
        sa.Column("error_message", sa.Text),
        sqlite_autoincrement=True,
    )
    return md
