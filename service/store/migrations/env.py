"""Alembic's entry point: runs the revisions on the connection and table prefix ``upgrade_schema`` passes."""

from __future__ import annotations

from alembic import context

from service.store.migrations import version_table

_config = context.config
context.configure(connection=_config.attributes["connection"],
                  version_table=version_table(_config.attributes["table_prefix"]))
with context.begin_transaction():
    context.run_migrations()
