"""The task table of split jobs on SQLite and PostgreSQL: phases gate claims, the host that read a source is
preferred for its tasks, stale tasks are found, a split job is left to its tasks by the job reaper."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from service.jobs import JobStatus, Stage, TaskStatus
from service.store import JobStore
from service.store.host_faults import HOST_FAULT_RETRIES
from tests.service_helpers import make_store

KINDS = ("sqlite", "postgresql")


def _split_job(store: JobStore, model: str, worker: str = "w1") -> str:
    job, _ = store.create_job({"model": model, "requantize": {"to": "fp8-block"}}, request_hash=model + worker)
    claimed = store.claim_next(worker)
    assert claimed is not None and claimed.id == job.id
    assert store.tasks.split(job.id, worker, claimed.attempt, source=model, payload={"model": model},
                             max_attempts=2)
    return job.id


def _shards(n: int) -> list[dict]:
    tasks = [{"kind": "write", "shard": f"model-{i}.safetensors", "phase": 2, "payload": {"i": i}} for i in range(n)]
    return [*tasks, {"kind": "finish", "shard": None, "phase": 3, "payload": {}}]


@pytest.mark.parametrize("kind", KINDS)
def test_phases_gate_claims_and_progress_counts_shards(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        job_id = _split_job(store, "org/a")
        plan = store.tasks.claim("w1", "host-a")
        assert plan is not None and plan.kind == "plan" and plan.attempt == 1
        assert store.tasks.claim("w2", "host-b") is None  # nothing else is stored yet
        assert store.tasks.heartbeat(plan, "w1") is JobStatus.RUNNING
        assert store.tasks.heartbeat(plan, "w2") is None  # not w2's task
        assert store.tasks.succeed(plan, "w1", {"report": {"k": 1}}, new_tasks=_shards(2))
        first, second = store.tasks.claim("w1", "host-a"), store.tasks.claim("w2", "host-b")
        assert {first.shard, second.shard} == {"model-0.safetensors", "model-1.safetensors"}
        assert store.tasks.claim("w3", "host-c") is None  # the finish waits for both shards
        job = store.get_job(job_id)
        assert (job.stage, job.stage_done, job.stage_total) == (Stage.CONVERT, 0, 2)
        assert store.tasks.succeed(first, "w1", {"n": 0})
        assert store.tasks.claim("w3", "host-c") is None
        assert store.tasks.succeed(second, "w2", {"n": 1})
        finish = store.tasks.claim("w3", "host-c")
        assert finish is not None and finish.kind == "finish"
        progress = [e.data for e in store.events.after(job_id) if e.kind == "progress"]
        convert = [(p["shards_done"], p["shards_total"]) for p in progress if p["stage"] == Stage.CONVERT.value]
        assert convert == [(0, 2), (1, 2), (2, 2)]
        # every progress event of a split job says where its shards stand, the plan's end and the finish's too
        assert [p["stage"] for p in progress] == ["analyze", "convert", "convert", "convert", "export"]
        assert {p["shards_total"] for p in progress} == {2}
        assert store.tasks.results(job_id, "write") == [{"n": 0}, {"n": 1}]


@pytest.mark.parametrize("kind", KINDS)
def test_the_host_that_read_a_source_is_preferred_for_its_tasks(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        older, newer = _split_job(store, "org/older"), _split_job(store, "org/newer", "w2")
        for job_id, host in ((older, "host-a"), (newer, "host-b")):
            plan = store.tasks.claim(f"on-{host}", host)
            assert plan.job_id == job_id
            assert store.tasks.succeed(plan, f"on-{host}", {}, new_tasks=_shards(2))
        # host-b read org/newer for its plan: it gets org/newer's shards before the older job's
        assert store.tasks.claim("b1", "host-b").job_id == newer
        assert store.tasks.claim("a1", "host-a").job_id == older
        assert store.tasks.claim("c1", "host-c").job_id == older  # no preference: the oldest


@pytest.mark.parametrize("kind", KINDS)
def test_a_silent_task_is_stale_and_its_job_is_not(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        job_id = _split_job(store, "org/a")
        plan = store.tasks.claim("w1", "host-a")
        time.sleep(1.2)
        assert store.find_stale(1.0) == []  # the job lives by its tasks
        assert [t.seq for t in store.tasks.stale(1.0)] == [plan.seq]
        assert store.tasks.release(plan, TaskStatus.QUEUED, stale_for_s=1.0)
        assert not store.tasks.succeed(plan, "w1", {})  # the silent worker's late result is refused
        again = store.tasks.claim("w2", "host-b")
        assert again.seq == plan.seq and again.attempt == 2
        store.set_status(job_id, JobStatus.CANCELLING)
        assert store.tasks.claim("w3", "host-c") is None
        assert store.tasks.settling() == [job_id]
        assert store.tasks.drop(job_id) == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_task_silent_on_its_last_attempt_fails_the_job_naming_its_shard(kind: str, tmp_path: Path) -> None:
    from service.artifacts import ArtifactDirs
    from service.workers.split_jobs import reap_stale_tasks

    dirs = ArtifactDirs(tmp_path / "jobs")
    with make_store(kind, tmp_path) as (store, _, _):
        job_id = _split_job(store, "org/a")
        plan = store.tasks.claim("w1", "host-a")
        assert store.tasks.succeed(plan, "w1", {}, new_tasks=_shards(2))
        # max_attempts is 2: the first HOST_FAULT_RETRIES losses, each on a host of its own, use up no attempt
        last = HOST_FAULT_RETRIES + 2
        for attempt in range(1, last + 1):
            task = store.tasks.claim(f"w{attempt}", f"host-{attempt}")
            assert (task.shard, task.attempt) == ("model-0.safetensors", attempt)
            time.sleep(1.2)
            other = store.tasks.claim("busy", "host-b")  # the other shard keeps heartbeating and finishes
            assert store.tasks.succeed(other, "busy", {"n": 1}) if other is not None else True
            reaped = reap_stale_tasks(store, dirs, 1.0)
            assert reaped == [(task.seq, TaskStatus.QUEUED if attempt < last else TaskStatus.FAILED)]
        job = store.get_job(job_id)
        assert job.status is JobStatus.FAILED and job.error_code == "worker_lost"
        assert "shard model-0.safetensors" in job.error_message and f"attempt {last} of {last}" in job.error_message
        statuses = {t.kind: t.status for t in store.tasks.of_job(job_id)}
        assert statuses["finish"] is TaskStatus.CANCELLED  # dropped, never claimed
        warnings = [e.data for e in store.events.after(job_id) if e.kind == "warning"]
        assert [(w["shard"], w["reason"]) for w in warnings] == [("model-0.safetensors", "worker_lost")] * (last - 1)


@pytest.mark.parametrize("kind", KINDS)
def test_the_finish_task_succeeds_in_the_write_that_records_the_job_s_success(kind: str, tmp_path: Path) -> None:
    """Nobody reads the job finished with its finish task running: both commit together, or neither does."""
    with make_store(kind, tmp_path) as (store, _, _):
        job_id = _split_job(store, "org/a")
        plan = store.tasks.claim("w1", "host-a")
        assert store.tasks.succeed(plan, "w1", {}, new_tasks=_shards(1))
        write = store.tasks.claim("w1", "host-a")
        assert store.tasks.succeed(write, "w1", {"n": 0})
        finish = store.tasks.claim("w1", "host-a")
        assert finish is not None and finish.kind == "finish"

        def publish_fails(conn) -> None:
            assert store.tasks.succeed_in(conn, finish, "w1", {"files": 1})
            raise OSError("the final directory is in the way")

        with pytest.raises(OSError):
            store.set_status(job_id, JobStatus.SUCCEEDED, before_commit=publish_fails)
        assert store.get_job(job_id).status is JobStatus.RUNNING
        assert [t.status for t in store.tasks.of_job(job_id, kind="finish")] == [TaskStatus.RUNNING]

        store.set_status(job_id, JobStatus.SUCCEEDED,
                         before_commit=lambda conn: store.tasks.succeed_in(conn, finish, "w1", {"files": 1}))
        assert store.get_job(job_id).status is JobStatus.SUCCEEDED
        assert {t.status for t in store.tasks.of_job(job_id)} == {TaskStatus.SUCCEEDED}
