"""Workers when things go wrong: a store that stops answering, a job taken away mid-run, a cancel that
arrives with the result, file races, crashed and stopped worker processes.

The conversion child here is ``fake_child`` (spawned exactly like the real one, by the real worker): it speaks
the child's protocol and writes files the way the pipeline does, and it can wait for a marker file, so each
test decides when the run may end instead of racing it.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from service.artifacts import ArtifactDirs
from service.config import Settings
from service.errors import InvalidTransition
from service.jobs import JobStatus
from service.store import JobStore
from service.workers import worker as worker_module
from service.workers.messages import Failed, Progress, StageStarted, Succeeded
from service.workers.outcome import AttemptOutcome
from service.workers.pool import WorkerPool
from service.workers.worker import Worker
from tests.service_helpers import children_since, leftovers, pid_alive, wait_for, work_children

STAGES = ("resolve", "analyze", "calibrate", "convert", "export")
PAYLOAD = b"\x01fp8" * 1000


def fake_child(request: dict[str, Any], out_dir: str, sources: dict[str, Any], conn: Any, stop: Any,
               worker_pid: int, **_: Any) -> None:
    """Stands in for ``service.workers.child.child_main``: stages, optional wait for ``request["go"]``, then files."""
    from service.workers.procs import die_with_worker

    die_with_worker(worker_pid)
    out = Path(out_dir)
    staging = out.parent / f".{out.name}.partial"
    staging.mkdir()
    conn.send(StageStarted(STAGES[0]))
    if request.get("internal_error"):  # what child_main sends for an exception that is not an Fp8ForgeError
        conn.send(Failed("internal_error", request["internal_error"]))
        conn.close()
        return
    go = request.get("go")
    deadline = time.monotonic() + 120
    while go and not Path(go).exists():
        if stop.is_set() or time.monotonic() > deadline:
            conn.send(Failed("cancelled", "stopped before the marker appeared"))
            conn.close()
            return
        time.sleep(0.02)
    for stage in STAGES[1:]:
        conn.send(StageStarted(stage))
        conn.send(Progress(1, 1))
    (staging / "model.safetensors").write_bytes(PAYLOAD)
    (staging / "manifest.json").write_text(json.dumps({"files": []}))
    os.replace(staging, out)
    conn.send(Succeeded([]))
    conn.close()


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("service.workers.runner.child_main", fake_child)
    settings = Settings(data_dir=tmp_path / "data", heartbeat_interval_s=0.2, heartbeat_timeout_s=30,
                        poll_interval_s=0.1)
    worker = Worker(settings)
    yield worker
    worker.store.close()


def _submit(worker: Worker, **fake: Any):
    job, _ = worker.store.create_job({"model": "fake", **fake}, request_hash=os.urandom(8).hex())
    return job


def _db_down() -> OperationalError:
    return OperationalError("UPDATE jobs ...", {}, Exception("server closed the connection unexpectedly"))


def _stages(worker: Worker, job_id: str) -> list[str]:
    return [e.data["stage"] for e in worker.store.events.after(job_id) if e.kind == "stage"]


def test_a_run_publishes_its_own_attempt_directory(worker: Worker) -> None:
    job = _submit(worker)
    assert worker.run_once()
    done = worker.store.get_job(job.id)
    assert done.status is JobStatus.SUCCEEDED and done.attempt == 1
    final = worker.dirs.final_dir(job.id)
    assert (final / "model.safetensors").read_bytes() == PAYLOAD
    assert sorted(a["name"] for a in done.artifacts) == ["manifest.json", "model.safetensors"]
    assert leftovers(worker.settings.jobs_dir) == []
    assert _stages(worker, job.id) == list(STAGES)


def test_an_internal_error_reaches_the_client_as_a_fact_not_as_raw_exception_text(
        worker: Worker, caplog: pytest.LogCaptureFixture) -> None:
    raw = "FileNotFoundError: [Errno 2] No such file or directory: '/srv/models/secret-project/config.json'"
    job = _submit(worker, internal_error=raw)
    with caplog.at_level("ERROR"):
        assert worker.run_once()
    failed = worker.store.get_job(job.id)
    assert failed.status is JobStatus.FAILED and failed.error_code == "internal_error"
    assert "secret-project" not in failed.error_message and "Errno" not in failed.error_message
    assert job.id in failed.error_message and "log" in failed.error_message
    assert raw in caplog.text  # the operator still sees what happened


def test_a_brief_store_outage_does_not_stop_the_run(worker: Worker, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    go = tmp_path / "go"
    job = _submit(worker, go=str(go))
    store = worker.store
    real_heartbeat, real_event, real_set = store.heartbeat_job, store.events.add, store.set_status
    failed = {"heartbeat": 0, "event": 0, "record": 0}

    def heartbeat_job(*args: Any, **kwargs: Any):
        if failed["heartbeat"] < 3:
            failed["heartbeat"] += 1
            raise _db_down()
        go.touch()  # the store answers again: the run may finish
        return real_heartbeat(*args, **kwargs)

    def add_event(*args: Any, **kwargs: Any):
        if failed["event"] < 2:
            failed["event"] += 1
            raise _db_down()
        return real_event(*args, **kwargs)

    def set_status(job_id: str, target: JobStatus, **kwargs: Any):
        if target is JobStatus.SUCCEEDED and not failed["record"]:
            failed["record"] += 1
            raise _db_down()
        return real_set(job_id, target, **kwargs)

    monkeypatch.setattr(store, "heartbeat_job", heartbeat_job)
    monkeypatch.setattr(store.events, "add", add_event)
    monkeypatch.setattr(store, "set_status", set_status)
    assert worker.run_once()

    assert failed == {"heartbeat": 3, "event": 2, "record": 1}
    done = store.get_job(job.id)
    assert done.status is JobStatus.SUCCEEDED, done
    assert (worker.dirs.final_dir(job.id) / "model.safetensors").read_bytes() == PAYLOAD
    assert leftovers(worker.settings.jobs_dir) == []
    assert _stages(worker, job.id) == list(STAGES)  # events held back during the outage arrive, in order


def test_a_store_that_stays_down_ends_the_attempt_after_the_heartbeat_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("service.workers.runner.child_main", fake_child)
    settings = Settings(data_dir=tmp_path / "data", heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0)
    before = set(work_children(os.getpid()))
    worker = Worker(settings)
    job = _submit(worker, go=str(tmp_path / "never"))
    store = worker.store

    def down(*_: Any, **__: Any):
        raise _db_down()

    monkeypatch.setattr(store, "heartbeat_job", down)
    started = time.monotonic()
    assert worker.run_once()
    assert time.monotonic() - started < 60  # it gave up; the child did not run into its own deadline
    assert children_since(os.getpid(), before) == []
    # Nothing was recorded (the store was down); the reaper requeues the job once it is stale.
    assert store.get_job(job.id).status is JobStatus.RUNNING
    assert leftovers(settings.jobs_dir) == [] and not worker.dirs.final_dir(job.id).exists()
    store.close()


def test_a_lost_attempt_publishes_nothing_and_leaves_the_newer_attempt_alone(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _submit(worker)
    store, dirs = worker.store, worker.dirs
    newer = dirs.attempt_dir(job.id, 2)
    real_record = AttemptOutcome.record

    def taken_then_record(outcome: AttemptOutcome, exitcode: int | None, **kwargs: Any):
        # the attempt's files are complete, but meanwhile a reaper requeued the job and another worker took it
        store.set_status(job.id, JobStatus.QUEUED, owner=worker.worker_id, worker_id=None)
        assert store.claim_next("other-worker").attempt == 2
        newer.mkdir()
        (newer / "model.safetensors").write_bytes(b"half")
        return real_record(outcome, exitcode, **kwargs)

    monkeypatch.setattr(AttemptOutcome, "record", taken_then_record)
    assert worker.run_once()

    now = store.get_job(job.id)
    assert (now.status, now.worker_id, now.attempt) == (JobStatus.RUNNING, "other-worker", 2)
    assert not dirs.final_dir(job.id).exists() and not dirs.attempt_dir(job.id, 1).exists()
    assert (newer / "model.safetensors").read_bytes() == b"half"
    assert leftovers(worker.settings.jobs_dir) == [newer.name]


def test_a_cancel_that_arrives_with_the_result_ends_cancelled(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _submit(worker)
    real_record = AttemptOutcome.record

    def cancelled_then_record(outcome: AttemptOutcome, exitcode: int | None, **kwargs: Any):
        worker.store.set_status(job.id, JobStatus.CANCELLING)
        return real_record(outcome, exitcode, **kwargs)

    monkeypatch.setattr(AttemptOutcome, "record", cancelled_then_record)
    assert worker.run_once()
    assert worker.store.get_job(job.id).status is JobStatus.CANCELLED
    assert not worker.dirs.final_dir(job.id).exists() and leftovers(worker.settings.jobs_dir) == []


def test_a_success_that_meets_a_changing_job_is_recorded_on_a_later_try(
        worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    job = _submit(worker)
    real_set = worker.store.set_status
    refused = []

    def set_status(job_id: str, target: JobStatus, **kwargs: Any):
        if target is JobStatus.SUCCEEDED and not refused:
            refused.append(target)
            raise InvalidTransition(f"job {job_id} kept changing; try again")
        return real_set(job_id, target, **kwargs)

    monkeypatch.setattr(worker.store, "set_status", set_status)
    assert worker.run_once()
    assert refused and worker.store.get_job(job.id).status is JobStatus.SUCCEEDED
    assert (worker.dirs.final_dir(job.id) / "model.safetensors").exists()
    assert leftovers(worker.settings.jobs_dir) == []


def test_the_worker_loop_survives_unexpected_errors(worker: Worker, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def reap(*_: Any) -> list:
        calls.append(1)
        if len(calls) == 1:
            raise FileNotFoundError("a job directory vanished under the reaper")
        return []

    monkeypatch.setattr(worker_module, "reap_stale", reap)
    thread = threading.Thread(target=worker.run)
    thread.start()
    try:
        wait_for(lambda: len(calls) >= 2, timeout=30, what="the loop to go on after the error")
        assert thread.is_alive()
    finally:
        worker.stop()
        thread.join(30)


def test_removing_tolerates_a_concurrent_remover(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    dirs = ArtifactDirs(tmp_path / "jobs")
    job_id = "0123456789abcdef0123456789abcdef"
    for path in (dirs.final_dir(job_id), dirs.attempt_dir(job_id, 1), dirs.staging_dir(job_id, 2)):
        path.mkdir(parents=True)
    real_replace = os.replace

    def replace_after_someone_else(src: Any, dst: Any) -> None:
        shutil.rmtree(src, ignore_errors=True)  # a reaper or a DELETE got there first
        real_replace(src, dst)

    monkeypatch.setattr("service.artifacts.local.os.replace", replace_after_someone_else)
    dirs.remove(job_id)
    dirs.remove_attempt(job_id, 1)
    assert leftovers(dirs.root) == [] and not dirs.final_dir(job_id).exists()


def test_cleanup_spares_newer_attempts_and_other_jobs(tmp_path: Path) -> None:
    dirs = ArtifactDirs(tmp_path / "jobs")
    job_id, other = "a" * 32, "b" * 32
    made = [dirs.final_dir(job_id), dirs.attempt_dir(job_id, 1), dirs.staging_dir(job_id, 2),
            dirs.attempt_dir(job_id, 3), dirs.staging_dir(job_id, 3), dirs.root / f".{job_id}.partial",
            dirs.root / f".{job_id}.0badc0de.deleting", dirs.attempt_dir(other, 1), dirs.final_dir(other)]
    for path in made:
        path.mkdir(parents=True)
    dirs.remove(job_id, below_attempt=3)
    left = sorted(p.name for p in dirs.root.iterdir())
    assert left == sorted([f".{job_id}.a3", f"..{job_id}.a3.partial", f".{other}.a1", other])
    dirs.remove(job_id)
    assert sorted(p.name for p in dirs.root.iterdir()) == sorted([f".{other}.a1", other])


def test_pool_restarts_a_crashed_worker_but_not_one_that_stopped(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", heartbeat_interval_s=0.2, poll_interval_s=0.2)
    pool = WorkerPool(settings, 2)
    pool.start()
    try:
        store = JobStore(settings.store_url)
        # each worker has installed its signal handlers once it heartbeats
        wait_for(lambda: len(store.workers.live(30)) == 2, timeout=60, what="two worker heartbeats")
        stopped, crashed = pool.pids
        os.kill(stopped, signal.SIGINT)  # the Ctrl-C of a shutting-down `fp8forge serve`
        os.kill(crashed, signal.SIGKILL)
        wait_for(lambda: not pid_alive(stopped) and not pid_alive(crashed), timeout=30, what="both to end")

        def both_seen_ended() -> bool:
            # /proc shows a process whose main thread has exited as a zombie while its other threads still finish,
            # before waitpid (the pool's view) reports it: the pool sees the end a moment later
            pool.check()
            return stopped not in pool.pids and crashed not in pool.pids

        wait_for(both_seen_ended, timeout=30, what="the pool to see both workers end")
        assert len(pool.pids) == 1  # only the crashed one came back
        store.close()
    finally:
        pool.stop()
    assert pool.pids == [] or all(not pid_alive(p) for p in pool.pids)
