"""Host faults (service.store.host_faults): the hosts that failed a job or task, how often, when it may go back;
the host of a job's attempt and of a worker."""

from __future__ import annotations

import sqlalchemy as sa

from service.store.migrations.revision_helpers import add_columns_if_missing, prefix

revision = "0002_host_faults"
down_revision = "0001_release_schema"
branch_labels = None
depends_on = None


def _host_fault_columns() -> list[sa.Column]:
    return [sa.Column("failed_hosts", sa.Text),
            sa.Column("host_faults", sa.Integer, nullable=False, server_default="0"),
            sa.Column("retry_after", sa.Double)]


def upgrade() -> None:
    p = prefix()
    add_columns_if_missing(f"{p}jobs", [*_host_fault_columns(), sa.Column("host", sa.String(255))])
    add_columns_if_missing(f"{p}job_tasks", _host_fault_columns())
    add_columns_if_missing(f"{p}workers", [sa.Column("host", sa.String(255))])
