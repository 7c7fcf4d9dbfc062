"""A database made by the previous release upgrades in place through the Alembic revisions, on both servers.

The previous release's own JobStore made tests/service/store/data/release-2026-12-01.json (tools/release_database.py:
its DDL for each dialect and every row it wrote); each test rebuilds that database, opens it with this release's
store, and checks that every job is kept and usable and that the tables match this release's metadata.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from service.jobs import JobStatus
from service.store import JobStore
from service.store.migrations import HEAD, version_table
from tests.service_helpers import postgres_url

RELEASE = json.loads((Path(__file__).parent / "data" / "release-2026-12-01.json").read_text())


def _release_database(kind: str, tmp_path: Path) -> tuple[str, str]:
    """Rebuild the previous release's database; returns (url, table prefix)."""
    if kind == "sqlite":
        url, prefix = f"sqlite:///{tmp_path / 'jobs.db'}", ""
    else:
        url = postgres_url()
        if url is None:
            pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (users postgres/root, database test)")
        prefix = f"m{uuid.uuid4().hex[:12]}_"
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for statement in RELEASE["ddl"][kind]:
            conn.execute(sa.text(statement.replace("{prefix}", prefix)))
        md = sa.MetaData()
        # this database's tables alone: other tests create and drop their own prefixes on the same server meanwhile,
        # and a table listed then dropped fails the whole reflection (NoSuchTableError)
        md.reflect(conn, only=lambda name, _metadata: name.startswith(prefix))
        for short, rows in RELEASE["rows"].items():
            if rows:
                conn.execute(md.tables[f"{prefix}{short}"].insert(), rows)
                if kind == "postgresql" and "seq" in rows[0]:  # as the release's own inserts would have left it
                    conn.execute(sa.text(f"SELECT setval(pg_get_serial_sequence('\"{prefix}{short}\"', 'seq'), "
                                         f"(SELECT max(seq) FROM \"{prefix}{short}\"))"))
    engine.dispose()
    return url, prefix


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_previous_release_database_upgrades_in_place_with_its_jobs(kind, tmp_path) -> None:
    url, prefix = _release_database(kind, tmp_path)
    store = JobStore(url, table_prefix=prefix)
    try:
        with store.engine.connect() as conn:
            versions = conn.execute(sa.text(f'SELECT version_num FROM "{version_table(prefix)}"')).scalars().all()
            # the server may hold other stores' tables (other prefixes): compare this store's own
            ours = set(store.tables.metadata.tables)
            context = MigrationContext.configure(conn, opts={
                "include_name": lambda name, kind, _parent: kind != "table" or name in ours})
            diffs = compare_metadata(context, store.tables.metadata)
        assert versions == [HEAD]
        assert [d for d in diffs if d[0] in ("add_column", "remove_column", "add_table", "remove_table")] == []
        old_jobs = {row["id"]: row for row in RELEASE["rows"]["jobs"]}
        for job_id, row in old_jobs.items():
            job = store.get_job(job_id)
            assert (job.status.value, job.error_code, job.owner) == (row["status"], row["error_code"], row["owner"])
        succeeded = next(i for i, r in old_jobs.items() if r["status"] == "succeeded")
        assert [a["bytes"] for a in store.get_job(succeeded).artifacts] == [4096]
        written = sum(e["job_id"] == succeeded for e in RELEASE["rows"]["job_events"])
        assert len(store.events.after(succeeded)) == written
        # the upgraded tables take this release's writes: a host-aware claim and a host fault on the queued job
        queued = next(i for i, r in old_jobs.items() if r["status"] == "queued")
        assert store.claim_next("w-new", host="h1").id == queued
        new, created = store.create_job({"model": "org/new"}, request_hash="n")
        assert created and new.status is JobStatus.QUEUED
        assert store.count_by_status()[JobStatus.QUEUED] == 1
        JobStore(url, table_prefix=prefix).close()  # a second start finds nothing to do
    finally:
        if kind == "sqlite":
            store.close()
        else:
            store.drop_all()
