"""A process stopped inside a PostgreSQL transaction must not stall the fleet.

The stopped process is a real second connection that locks a job's row inside an open transaction and never
commits: what a worker SIGSTOPped inside its success write leaves behind. The workers are real (``Worker`` with
the spawned ``fake_child`` of ``test_worker_faults``), the database is the real PostgreSQL.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError, OperationalError

from service.artifacts import ArtifactDirs
from service.config import Settings
from service.jobs import JobStatus
from service.store import JobStore
from service.store.schema import StoreTimeouts
from service.workers.reaper import reap_stale
from service.workers.worker import Worker
from tests.service.workers.test_worker_faults import fake_child
from tests.service_helpers import make_store, wait_for

pytestmark = pytest.mark.postgres

#: IDLE_S bounds how long the stopped session holds its row: the other key's job must finish inside it (a spawned
#: child on a busy 2-core machine took over 6 s), and the stalled job's retry waits for it.
LOCK_S, IDLE_S = 0.5, 20.0
TIMEOUTS = StoreTimeouts(lock_s=LOCK_S, statement_s=1.0, idle_in_transaction_s=IDLE_S)
HEARTBEAT_TIMEOUT_S = 1.0


@pytest.fixture
def store(tmp_path: Path) -> Iterator[JobStore]:
    """A PostgreSQL store of its own table prefix, with short lock and idle-in-transaction timeouts."""
    with make_store("postgresql", tmp_path) as (_, url, prefix):
        store = JobStore(url, table_prefix=prefix, timeouts=TIMEOUTS)
        try:
            yield store
        finally:
            store.close()


def _settings(tmp_path: Path) -> Settings:
    return Settings(data_dir=tmp_path / "data", heartbeat_interval_s=0.2, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                    poll_interval_s=0.1, store_lock_timeout_s=LOCK_S, store_idle_in_transaction_timeout_s=IDLE_S)


@contextlib.contextmanager
def holding_the_row(store: JobStore, job_id: str, *, write: bool) -> Iterator[sa.Connection]:
    """A session of the store's own kind that locks the job's row and then sits idle inside its transaction.

    ``write``: it changed the row as a worker's success write does; else it only locked it (``FOR UPDATE``).
    """
    jobs = store.tables.jobs
    conn = store.engine.connect()
    conn.begin()
    if write:
        conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(status=JobStatus.SUCCEEDED.value))
    else:
        conn.execute(sa.select(jobs.c.seq).where(jobs.c.id == job_id).with_for_update())
    try:
        yield conn
    finally:
        with contextlib.suppress(DBAPIError):  # the server may have ended the session already
            conn.rollback()
        conn.close()


@contextlib.contextmanager
def running(worker: Worker) -> Iterator[threading.Thread]:
    thread = threading.Thread(target=worker.run, name="test-worker", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        worker.stop()
        thread.join(30)


def test_sessions_carry_the_timeouts(store: JobStore) -> None:
    with store.engine.connect() as conn:
        shown = {name: conn.execute(sa.text(f"SHOW {name}")).scalar()
                 for name in ("lock_timeout", "statement_timeout", "idle_in_transaction_session_timeout")}
        assert shown == {"lock_timeout": "500ms", "statement_timeout": "1s",
                         "idle_in_transaction_session_timeout": f"{IDLE_S:g}s"}
        started = time.monotonic()
        with pytest.raises(OperationalError, match="statement timeout"):
            conn.execute(sa.text("SELECT pg_sleep(30)"))
        assert time.monotonic() - started < 10


def test_the_settings_defaults_are_the_stores_and_url_options_win(store: JobStore) -> None:
    fields = Settings.model_fields
    assert StoreTimeouts() == StoreTimeouts(
        lock_s=fields["store_lock_timeout_s"].default, statement_s=fields["store_statement_timeout_s"].default,
        idle_in_transaction_s=fields["store_idle_in_transaction_timeout_s"].default)
    url = store.engine.url.render_as_string(hide_password=False)
    own = JobStore(f"{url}?options=-c%20lock_timeout%3D7000", table_prefix=store.tables.jobs.name[:-4],
                   timeouts=TIMEOUTS)
    try:
        with own.engine.connect() as conn:
            assert conn.execute(sa.text("SHOW lock_timeout")).scalar() == "7s"
            assert conn.execute(sa.text("SHOW statement_timeout")).scalar() == "1s"
    finally:
        own.close()


def test_a_claimer_stopped_inside_its_claim_holds_up_other_claims_for_the_lock_timeout_at_most(
        store: JobStore) -> None:
    job, _ = store.create_job({"model": "fake"}, request_hash="a", owner="alice")
    turn = sa.func.pg_advisory_xact_lock(sa.func.hashtext(f"fp8forge-claim:{store.tables.jobs.name}"))
    with store.engine.connect() as stopped_claimer:
        stopped_claimer.begin()
        stopped_claimer.execute(sa.select(turn))  # holds the claims' turn, as inside its claim
        with ThreadPoolExecutor(1) as pool:
            started = time.monotonic()
            claim = pool.submit(store.claim_next, "w", max_running_per_owner=2)
            try:
                assert claim.result(timeout=10) is None  # not now
                assert time.monotonic() - started < LOCK_S + 1
            finally:
                stopped_claimer.rollback()  # lets a claim that waits for good finish, so the test can end
    assert store.claim_next("w", max_running_per_owner=2).id == job.id


def test_a_stopped_worker_holding_its_row_stalls_neither_the_reaper_nor_other_keys_jobs(
        store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("service.workers.runner.child_main", fake_child)
    stalled, _ = store.create_job({"model": "fake"}, request_hash="a", owner="alice")
    assert store.claim_next("stopped-worker").id == stalled.id
    other, _ = store.create_job({"model": "fake"}, request_hash="b", owner="bob")
    reaper = ThreadPoolExecutor(1)
    try:
        with holding_the_row(store, stalled.id, write=True):
            idle_since = time.monotonic()
            time.sleep(HEARTBEAT_TIMEOUT_S + 0.3)  # the stopped worker's job is now stale
            started = time.monotonic()
            reaped = reaper.submit(reap_stale, store, ArtifactDirs(tmp_path / "data" / "jobs"), HEARTBEAT_TIMEOUT_S)
            assert reaped.result(timeout=10) == []  # the held job is skipped for now, at once
            assert time.monotonic() - started < 2 * LOCK_S + 1

            worker = Worker(_settings(tmp_path), store=store)
            # a job runs in a child process: on a busy 2-core machine (three test processes) it can take a while
            with running(worker):
                done = wait_for(lambda: _finished(store, other.id), timeout=120, what="another key's job to finish")
                assert done.status is JobStatus.SUCCEEDED and done.worker_id == worker.worker_id
                # still the stopped worker's, unless the other job took so long that the server has already ended
                # the idle session (IDLE_S after it went idle: seen on a loaded machine), which is the next step
                held = store.get_job(stalled.id)
                assert (held.status is JobStatus.RUNNING and held.attempt == 1) or \
                    time.monotonic() - idle_since >= IDLE_S, held

                # the server ends the stopped worker's idle session, its lock with it: the job is retried
                again = wait_for(lambda: _finished(store, stalled.id), timeout=120,
                                 what="the stalled job to be reaped and retried")
                assert again.status is JobStatus.SUCCEEDED and again.attempt == 2
    finally:
        reaper.shutdown(wait=True)  # a reaper that hung (no lock handling) returns once the row is released
    reasons = [e.data.get("reason") for e in store.events.after(stalled.id) if e.kind == "status"]
    assert reasons.count("worker_lost") == 1


def test_a_worker_whose_own_row_is_held_goes_on_with_other_jobs(
        store: JobStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr("service.workers.runner.child_main", fake_child)
    go = tmp_path / "go"
    held, _ = store.create_job({"model": "fake", "go": str(go)}, request_hash="a", owner="alice")
    worker = Worker(_settings(tmp_path), store=store)
    with caplog.at_level("WARNING", logger="service"), running(worker) as thread:
        wait_for(lambda: store.get_job(held.id).status is JobStatus.RUNNING, timeout=30, what="the claim")
        with holding_the_row(store, held.id, write=False):  # e.g. an API process stopped inside a cancel
            other, _ = store.create_job({"model": "fake"}, request_hash="b", owner="bob")
            go.touch()  # the run ends while its worker cannot write the job's row
            done = wait_for(lambda: _finished(store, other.id), timeout=120, what="the worker to go on")
            assert done.status is JobStatus.SUCCEEDED and thread.is_alive()
        again = wait_for(lambda: _finished(store, held.id), timeout=120, what="the held job to be retried")
        assert again.status is JobStatus.SUCCEEDED
    records = [r for r in caplog.records if r.name.startswith("service.")]
    assert any("lock timeout" in r.getMessage() for r in records), [r.getMessage() for r in records]
    assert not [r.getMessage() for r in records if r.exc_info], "a lock timeout is no crash: no tracebacks"


def _finished(store: JobStore, job_id: str):
    job = store.get_job(job_id)
    return job if job.status.is_finished else None
