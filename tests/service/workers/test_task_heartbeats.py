"""A task whose result takes long to store does not stop its worker's heartbeat (issue 34, finding 4: a huge plan
result stalled the heartbeats, and the job read as worker_lost).

A real `fp8forge serve` with one worker on PostgreSQL. A trigger makes PostgreSQL take SLOW_STORE_S seconds to
store the plan task's result (as a large result does): while it does, the worker stays live (its heartbeat is
fresher than the heartbeat timeout, which is far shorter), and the job succeeds with every task on its first
attempt. The heartbeat timeout is a bound the test needs; it is generous against the 0.25 s heartbeat interval.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.jobs import TaskStatus
from service.store import JobStore
from tests.service.test_requantize_jobs import (  # noqa: F401 - the module's sharded model fixture
    _finished,
    _submit,
    model_dir,
    serving,
)
from tests.service.workers.test_multi_host import fresh_database
from tests.service_helpers import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SLOW_STORE_S = 6
TIMEOUT_S = 2.0
# The plan's result adds the job's finish task: storing that row is what PostgreSQL takes SLOW_STORE_S over.
SLOW_RESULT = f"""
CREATE FUNCTION fp8forge_slow_store() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_sleep({SLOW_STORE_S}); RETURN NEW; END $$;
CREATE TRIGGER fp8forge_slow_store BEFORE INSERT ON job_tasks FOR EACH ROW WHEN (NEW.kind = 'finish')
EXECUTE FUNCTION fp8forge_slow_store();
"""
STORING = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event = 'PgSleep'"


def test_a_task_result_that_takes_long_to_store_leaves_the_worker_live(tmp_path: Path, model_dir: Path) -> None:  # noqa: F811
    with fresh_database() as db_url:
        store = JobStore(db_url)  # the schema, then the trigger on it
        with store.engine.begin() as conn:
            conn.execute(sa.text(SLOW_RESULT))
        env = {"FP8FORGE_HEARTBEAT_INTERVAL_S": "0.25", "FP8FORGE_HEARTBEAT_TIMEOUT_S": str(TIMEOUT_S)}
        try:
            with serving(tmp_path, model_dir, workers=1, database=db_url, settings=env) as server, \
                    server.client() as client:
                wait_for(lambda: store.workers.live(TIMEOUT_S), timeout=60, what="the worker's heartbeat")
                job_id = _submit(client, model_dir, "fp8-block")
                wait_for(lambda: _storing(store), timeout=180, interval=0.05,
                         what=f"the plan's result to be stored\n{server.tail()}")
                samples, silent = 0, 0
                while _storing(store):
                    samples += 1
                    silent += not store.workers.live(TIMEOUT_S)
                    time.sleep(0.1)
                assert samples > 10 * TIMEOUT_S  # it was watched for longer than the heartbeat timeout
                assert silent == 0, f"the worker went silent in {silent} of {samples} looks\n{server.tail()}"

                done = wait_for(lambda: _finished(client, job_id), timeout=300, what="the job to finish")
                assert done["status"] == "succeeded", (done, server.tail())
                # the finish task's row is recorded just after the job's success (publishing first keeps a worker
                # killed in between from leaving a job no one finishes), so it is waited for, not read at once
                tasks = wait_for(lambda: _all_settled(store.tasks.of_job(job_id)), timeout=30,
                                 what="the finish task's row")
                assert [(t.name, t.attempt) for t in tasks if t.attempt != 1] == []
                assert all(t.status is TaskStatus.SUCCEEDED for t in tasks), tasks
                assert [e.data for e in store.events.after(job_id) if e.data.get("reason") == "worker_lost"] == []
        finally:
            store.close()


def _all_settled(tasks: list) -> list | None:
    """``tasks`` once none of them is running any more, else None."""
    return tasks if tasks and all(t.status is not TaskStatus.RUNNING for t in tasks) else None


def _storing(store: JobStore) -> bool:
    """Whether PostgreSQL is storing the result now (a connection of its own: the activity view is read once per
    transaction)."""
    with store.engine.connect() as conn:
        return bool(conn.execute(sa.text(STORING)).scalar())
