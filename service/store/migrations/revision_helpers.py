"""What the revisions share: the store's table prefix and presence checks that make each step safe to rerun."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context, op


def prefix() -> str:
    return context.config.attributes["table_prefix"]


def existing_tables() -> set[str]:
    return set(sa.inspect(op.get_bind()).get_table_names())


def add_columns_if_missing(table: str, columns: list[sa.Column]) -> None:
    """Add the ``columns`` ``table`` lacks: a database adopted from before the migrations may have some already."""
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns(table)}
    for column in columns:
        if column.name not in present:
            op.add_column(table, column)
