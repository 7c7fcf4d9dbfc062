"""A calibrated job's serving shard tasks in the task table, on SQLite and PostgreSQL: its worker queues them for
its own attempt only, they count as shards, the job keeps living by its own heartbeat (the job reaper watches it),
and a cancelling such job is its worker's to settle, not the task reaper's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from service.jobs import JobStatus, Stage, TaskStatus
from service.store import JobStore
from service.store.tasks import SERVING_WRITE
from tests.service_helpers import make_store

KINDS = ("sqlite", "postgresql")


def _calibrated_job(store: JobStore, worker: str = "w1") -> tuple[str, int]:
    job, _ = store.create_job({"model": "org/m", "serving_formats": ["fp8-block"]}, request_hash=worker)
    claimed = store.claim_next(worker)
    assert claimed is not None and claimed.id == job.id
    return job.id, claimed.attempt


def _writes(n: int) -> list[dict]:
    return [{"kind": SERVING_WRITE, "shard": f"model-{i}.safetensors", "payload": {"plan": {"format": "fp8-block"}}}
            for i in range(n)]


@pytest.mark.parametrize("kind", KINDS)
def test_the_jobs_worker_queues_its_attempts_shards_and_any_worker_claims_them(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        job_id, attempt = _calibrated_job(store)
        assert not store.tasks.add_serving_writes(job_id, "w2", attempt, source="org/m", tasks=_writes(2),
                                                  max_attempts=2), "not w2's job"
        assert store.tasks.of_job(job_id) == []
        assert store.tasks.add_serving_writes(job_id, "w1", attempt, source="org/m", tasks=_writes(2),
                                              max_attempts=2)
        first = store.tasks.claim("w2", "host-b")
        assert first is not None and first.kind == SERVING_WRITE and first.payload["attempt"] == attempt
        second = store.tasks.claim("w1", "host-a", job_id="another-job")
        assert second is None  # a claim for one job takes nothing of another
        second = store.tasks.claim("w1", "host-a", job_id=job_id)
        assert second is not None and second.seq != first.seq
        assert store.tasks.succeed(first, "w2", {"file": first.shard})
        assert store.tasks.succeed(second, "w1", {"file": second.shard})
        progress = [e.data for e in store.events.after(job_id) if e.kind == "progress"]
        assert [(p["shards_done"], p["shards_total"]) for p in progress] == [(0, 2), (1, 2), (2, 2)]
        job = store.get_job(job_id)
        assert (job.status, job.stage, job.stage_done, job.stage_total) == (JobStatus.RUNNING, Stage.EXPORT, 2, 2)
        assert [t.result["file"] for t in store.tasks.serving_writes(job_id, attempt)] == [
            "model-0.safetensors", "model-1.safetensors"]
        assert store.tasks.serving_writes(job_id, attempt + 1) == []


@pytest.mark.parametrize("kind", KINDS)
def test_a_job_handing_out_shards_is_watched_by_its_own_heartbeat(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        job_id, attempt = _calibrated_job(store)
        assert store.tasks.add_serving_writes(job_id, "w1", attempt, source="org/m", tasks=_writes(3),
                                              max_attempts=2)
        time.sleep(1.2)
        assert [job.id for job in store.find_stale(1.0)] == [job_id]  # its worker went silent: requeued
        store.set_status(job_id, JobStatus.CANCELLING)
        assert store.tasks.settling() == []  # its worker settles it (the conversion stops, then records)
        assert not store.tasks.is_split(job_id)


@pytest.mark.parametrize("kind", KINDS)
def test_a_new_attempt_cancels_the_shards_an_earlier_one_left_queued(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        job_id, attempt = _calibrated_job(store)
        assert store.tasks.add_serving_writes(job_id, "w1", attempt, source="org/m", tasks=_writes(2),
                                              max_attempts=2)
        running = store.tasks.claim("w2", "host-b")
        store.set_status(job_id, JobStatus.QUEUED)  # requeued: w1 went silent
        again = store.claim_next("w3")
        assert again is not None and again.attempt == attempt + 1
        assert store.tasks.add_serving_writes(job_id, "w3", again.attempt, source="org/m", tasks=_writes(2),
                                              max_attempts=2)
        statuses = {(t.payload["attempt"], t.status) for t in store.tasks.of_job(job_id)}
        assert statuses == {(attempt, TaskStatus.RUNNING), (attempt, TaskStatus.CANCELLED),
                            (again.attempt, TaskStatus.QUEUED)}
        assert running.seq in {t.seq for t in store.tasks.of_job(job_id) if t.status is TaskStatus.RUNNING}
        progress = [e.data for e in store.events.after(job_id) if e.kind == "progress"]
        assert (progress[-1]["shards_done"], progress[-1]["shards_total"]) == (0, 3)  # the cancelled one is not counted
