"""Host faults in the store, on SQLite and PostgreSQL: a job or task that failed because of its host (a full disk, a
lost worker) is left to workers on other hosts while one of them is live, even by the host that read its source;
it goes back to a failed host only when every live host has failed it, and then only after a back-off; such retries
use up no attempt, and there are HOST_FAULT_RETRIES of them before a host fault counts as an attempt. An older
database gains the columns this needs in place."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from service.jobs import JobStatus, TaskStatus
from service.store import JobStore
from service.store.host_faults import HOST_FAULT_RETRIES, public_host_name
from service.store.tasks import HostFaultRetry
from tests.service_helpers import make_store

KINDS = ("sqlite", "postgresql")
LIVE_S = 30.0


def _live(store: JobStore, *hosts: str) -> None:
    for host in hosts:
        store.workers.heartbeat(f"worker-on-{host}", host=host)


def _shard_task(store: JobStore, host: str) -> tuple[str, object]:
    """A split job whose plan ``host`` ran (so it holds the source), and one of its shard tasks claimed there."""
    job, _ = store.create_job({"model": "org/a", "requantize": {"to": "fp8-block"}}, request_hash="h")
    store.claim_next("splitter")
    assert store.tasks.split(job.id, "splitter", 1, source="org/a", payload={}, max_attempts=2)
    plan = store.tasks.claim(f"worker-on-{host}", host)
    shards = [{"kind": "write", "shard": "model-0.safetensors", "phase": 2, "payload": {}}]
    assert store.tasks.succeed(plan, f"worker-on-{host}", {}, new_tasks=shards)
    task = store.tasks.claim(f"worker-on-{host}", host)
    assert task.shard == "model-0.safetensors" and task.attempt == 1
    return job.id, task


@pytest.mark.parametrize("kind", KINDS)
def test_a_shard_that_filled_a_hosts_disk_goes_to_another_live_host(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        _live(store, "full", "roomy")
        job_id, task = _shard_task(store, "full")
        retry, hosts = store.tasks.release_host_fault(task, worker_id="worker-on-full",
                                                      error=("disk_full", "no space left"))
        assert retry is HostFaultRetry.ELSEWHERE
        assert hosts["host"] == public_host_name("full") and hosts["failed_hosts"] == [public_host_name("full")]
        # the full host read the source (its affinity), but may not take the retry while "roomy" is live
        assert store.tasks.claim("worker-on-full", "full", live_within_s=LIVE_S) is None
        again = store.tasks.claim("worker-on-roomy", "roomy", live_within_s=LIVE_S)
        assert again.seq == task.seq and (again.attempt, again.max_attempts) == (2, 3)  # no attempt used up
        (event,) = [e.data for e in store.events.after(job_id) if e.kind == "retry"]
        assert event["host"] == public_host_name("roomy") and event["failed_hosts"] == [public_host_name("full")]
        assert event["shard"] == "model-0.safetensors"


@pytest.mark.parametrize("kind", KINDS)
def test_a_task_every_live_host_failed_goes_back_after_a_back_off(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        _live(store, "a")
        _, task = _shard_task(store, "a")
        assert store.tasks.release_host_fault(task, worker_id="worker-on-a", error=("disk_full", "x"))[0] \
            is HostFaultRetry.ELSEWHERE
        assert store.tasks.claim("worker-on-a", "a", live_within_s=LIVE_S) is None  # within its back-off
        time.sleep(2.2)  # the first back-off is 2 s
        again = store.tasks.claim("worker-on-a", "a", live_within_s=LIVE_S)
        assert again.seq == task.seq and again.attempt == 2


@pytest.mark.parametrize("kind", KINDS)
def test_host_fault_retries_are_bounded_then_use_up_attempts(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        _, task = _shard_task(store, "h0")
        for n in range(1, HOST_FAULT_RETRIES + 1):
            assert store.tasks.release_host_fault(task, worker_id=task.worker_id, error=("disk_full", "x"))[0] \
                is HostFaultRetry.ELSEWHERE
            task = store.tasks.claim(f"worker-on-h{n}", f"h{n}")
            assert (task.attempt, task.max_attempts) == (n + 1, n + 2)
        assert store.tasks.release_host_fault(task, worker_id=task.worker_id, error=("disk_full", "x"))[0] \
            is HostFaultRetry.SPENT
        assert store.tasks.release(task, TaskStatus.QUEUED, worker_id=task.worker_id)  # the caller counts it


@pytest.mark.parametrize("kind", KINDS)
def test_a_job_whose_host_failed_it_is_left_to_a_live_worker_elsewhere(kind: str, tmp_path: Path) -> None:
    with make_store(kind, tmp_path) as (store, _, _):
        _live(store, "full", "roomy")
        job, _ = store.create_job({"model": "org/a"}, request_hash="h", max_attempts=3)
        claimed = store.claim_next("worker-on-full", host="full", live_within_s=LIVE_S)
        fault = store.host_fault(job.id)
        assert fault is not None and fault.event["host"] == public_host_name("full")
        store.set_status(job.id, JobStatus.QUEUED, owner="worker-on-full", owner_attempt=claimed.attempt,
                         worker_id=None, event={"reason": "disk_full", **fault.event}, **fault.values)
        assert store.claim_next("worker-on-full", host="full", live_within_s=LIVE_S) is None
        again = store.claim_next("worker-on-roomy", host="roomy", live_within_s=LIVE_S)
        assert again.id == job.id and (again.attempt, again.max_attempts) == (2, 4)
        running = [e.data for e in store.events.after(job.id) if e.data.get("status") == "running"]
        assert [r["host"] for r in running] == [public_host_name("full"), public_host_name("roomy")]


@pytest.mark.parametrize("kind", KINDS)
def test_a_job_of_a_lost_worker_is_retried_on_another_host(kind: str, tmp_path: Path) -> None:
    from service.artifacts import ArtifactDirs
    from service.workers.reaper import reap_stale

    with make_store(kind, tmp_path) as (store, _, _):
        job, _ = store.create_job({"model": "org/a"}, request_hash="h", max_attempts=1)
        store.claim_next("lost-worker", host="lost")
        time.sleep(1.2)
        assert reap_stale(store, ArtifactDirs(tmp_path / "jobs"), 1.0) == [(job.id, JobStatus.QUEUED)]
        (requeued,) = [e.data for e in store.events.after(job.id) if e.data.get("status") == "queued"
                       and e.data.get("reason")]
        assert requeued["reason"] == "worker_lost" and requeued["host"] == public_host_name("lost")
        retried = store.claim_next("other", host="other")
        assert retried.id == job.id and (retried.attempt, retried.max_attempts) == (2, 2)
