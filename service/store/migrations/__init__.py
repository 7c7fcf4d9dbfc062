"""The job store's schema as Alembic migrations: ``upgrade_schema`` brings any earlier database to the head.

Each store's tables carry a prefix (tests and shared databases run several stores side by side), so the prefix
reaches the revisions through ``Config.attributes`` and each store has its own version table,
``<prefix>alembic_version``. A database made before the migrations existed has the tables and no version table:
the first revision creates only what is missing, so it adopts such a database in place.
"""

from __future__ import annotations

import threading
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config

__all__ = ["HEAD", "upgrade_schema", "version_table"]

_HERE = Path(__file__).parent
#: The newest revision: a store whose version table says this is up to date.
HEAD = "0002_host_faults"
# Alembic's ``context``/``op`` are module-level proxies set for the length of one run: two threads of a process
# opening stores at once (an API's pools, a test's claimers) would remove each other's
_ALEMBIC_RUN = threading.Lock()


def version_table(prefix: str) -> str:
    return f"{prefix}alembic_version"


def upgrade_schema(conn: sa.Connection, prefix: str) -> None:
    """Run every revision ``conn``'s database lacks, inside ``conn``'s transaction."""
    if _version(conn, prefix) == HEAD:
        return  # the common start: nothing to run, and no need to load the revisions
    config = Config()
    config.set_main_option("script_location", str(_HERE))
    config.attributes.update(connection=conn, table_prefix=prefix)
    with _ALEMBIC_RUN:
        command.upgrade(config, "head")


def _version(conn: sa.Connection, prefix: str) -> str | None:
    if not sa.inspect(conn).has_table(version_table(prefix)):
        return None
    versions = conn.execute(sa.text(f'SELECT version_num FROM "{version_table(prefix)}"')).scalars().all()
    return versions[0] if len(versions) == 1 else None
