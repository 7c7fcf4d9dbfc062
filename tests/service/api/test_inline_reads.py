"""A status poll reads a SQLite store on the event loop: it must never wait for a writer, nor see stale rows."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from service.config import Settings
from tests.service_helpers import live_app, make_store

JOB = {"model": "demo/tiny-llama", "recipe": {"backend": "ao"}, "calibration": {"steps": 2, "batch_size": 1}}


@pytest.mark.parametrize("kind, inline",
                         [("sqlite", True), pytest.param("postgresql", False, marks=pytest.mark.postgres)])
def test_only_a_sqlite_store_is_read_on_the_event_loop(kind: str, inline: bool, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        assert store.reads_inline is inline


def test_a_poll_answers_while_a_writer_holds_the_database_and_then_sees_its_commit(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", workers=0, auth_disabled=True)
    with live_app(settings) as client:
        job = client.post("/v1/jobs", json=JOB).json()
        writer = sqlite3.connect(settings.store_url.removeprefix("sqlite:///"), isolation_level=None)
        try:
            writer.execute("BEGIN IMMEDIATE")  # the write lock, as a worker's status update holds it
            writer.execute("UPDATE jobs SET status = 'cancelled' WHERE id = ?", (job["id"],))
            # WAL: the read is answered from the last commit instead of waiting out the 30 s busy timeout
            during = client.get(f"/v1/jobs/{job['id']}", timeout=5)
            assert (during.status_code, during.json()["status"]) == (200, "queued")
            writer.execute("COMMIT")
            after = client.get(f"/v1/jobs/{job['id']}", timeout=5)
            assert after.json()["status"] == "cancelled"  # no read snapshot outlives its request
        finally:
            writer.close()
