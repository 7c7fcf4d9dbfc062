"""Record a database as an earlier release of the job store makes it, for the upgrade test.

Run with that release's ``service`` package first on the path (e.g. ``git archive <rev> service converters`` unpacked
into DIR): ``PYTHONPATH=DIR python tools/release_database.py OUT.json``. It lets that release's own JobStore create
the tables, submit, claim, finish, fail and split jobs, then writes the DDL its metadata emits on SQLite and
PostgreSQL (table names with a ``{prefix}`` placeholder) and every row, so tests/service/store/test_migrations.py can
rebuild the same database on either server without that release's code.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.schema import CreateIndex, CreateTable

PREFIX = "relprefix_"


def main(out: Path) -> None:
    from service.jobs import JobStatus
    from service.store import JobStore

    with tempfile.TemporaryDirectory() as tmp:
        store = JobStore(f"sqlite:///{tmp}/jobs.db", table_prefix=PREFIX)
        done, _ = store.create_job({"model": "org/a", "recipe": {"backend": "te"}}, request_hash="a", owner="alice")
        failed, _ = store.create_job({"model": "org/b"}, request_hash="b", idempotency_key="k1", max_attempts=2)
        split, _ = store.create_job({"model": "org/c", "requantize": {"to": "fp8-block"}}, request_hash="c")
        store.create_job({"model": "org/d"}, request_hash="d")  # stays queued
        for _ in range(3):
            store.claim_next("w-release")
        store.set_status(done.id, JobStatus.SUCCEEDED, artifacts=[{"name": "model.safetensors", "bytes": 4096,
                                                                  "sha256": "ab" * 32}])
        store.set_status(failed.id, JobStatus.FAILED, error_code="model_not_found", error_message="no such model")
        store.tasks.split(split.id, "w-release", 1, source="org/c", payload={"to": "fp8-block"}, max_attempts=3)
        store.timings.record(done.id, [("calibrate", 1.5), ("export", 0.5)])
        store.workers.heartbeat("w-release", done.id)
        md = store.tables.metadata
        rows = {}
        with store.engine.connect() as conn:
            for table in md.sorted_tables:
                rows[table.name.removeprefix(PREFIX)] = [dict(r._mapping) for r in conn.execute(sa.select(table))]
    ddl = {name: [str(CreateTable(t).compile(dialect=dialect)).strip() for t in md.sorted_tables]
           + [str(CreateIndex(i).compile(dialect=dialect)).strip() for t in md.sorted_tables for i in t.indexes]
           for name, dialect in (("sqlite", sqlite.dialect()), ("postgresql", postgresql.dialect()))}
    ddl = {k: [s.replace(PREFIX, "{prefix}") for s in v] for k, v in ddl.items()}
    out.write_text(json.dumps({"ddl": ddl, "rows": rows}, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
