"""The job store on real SQLite and real PostgreSQL: persistence, idempotency, atomic claims, reaping."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from service.artifacts import ArtifactDirs
from service.errors import IdempotencyConflict, InvalidRequest, InvalidTransition, JobNotFound
from service.jobs import JobStatus, Stage
from service.store import JobLost, JobStore
from service.store.workers import WorkerRegistry
from service.workers.reaper import reap_stale
from tests.service_helpers import make_store

KINDS = ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
REQUEST = {"model": "demo/tiny-llama", "recipe": {"backend": "ao"}}


@pytest.fixture(params=KINDS)
def env(request: pytest.FixtureRequest, tmp_path: Path):
    with make_store(request.param, tmp_path) as (store, url, prefix):
        yield store, url, prefix


def _submit(store: JobStore, n: int = 1, **kw) -> list:
    return [store.create_job({**REQUEST, "n": i}, request_hash=f"h{i}", **kw)[0] for i in range(n)]


def test_jobs_survive_reopening_the_store(env) -> None:
    store, url, prefix = env
    (job,) = _submit(store)
    reopened = JobStore(url, table_prefix=prefix)
    try:
        again = reopened.get_job(job.id)
        assert again.status is JobStatus.QUEUED and again.request == job.request
    finally:
        reopened.close()


def test_list_is_newest_first_with_cursor_and_status_filter(env) -> None:
    store, _, _ = env
    jobs = _submit(store, 5)
    store.set_status(jobs[1].id, JobStatus.CANCELLED)
    page1, cursor = store.list_jobs(limit=2)
    page2, cursor2 = store.list_jobs(limit=2, cursor=cursor)
    page3, cursor3 = store.list_jobs(limit=2, cursor=cursor2)
    assert [j.id for j in page1 + page2 + page3] == [j.id for j in reversed(jobs)]
    assert cursor3 is None
    assert [j.id for j in store.list_jobs(status=JobStatus.CANCELLED)[0]] == [jobs[1].id]
    for bad in ("not-a-cursor", "²", "9" * 30, "", "-1", " 1"):
        with pytest.raises(InvalidRequest):
            store.list_jobs(cursor=bad)


def test_a_page_of_jobs_leaves_the_calibration_texts_in_the_database(env) -> None:
    store, _, _ = env
    texts = ["x" * 200_000, "é✓ " * 50_000]  # a page may list 200 jobs: their texts would be 200 request bodies
    request = {**REQUEST, "calibration": {"steps": 3, "texts": texts}, "include": ["model.layers.*"]}
    job, _ = store.create_job(request, request_hash="t")
    plain, _ = store.create_job(REQUEST, request_hash="p")
    listed = {j.id: j.request for j in store.list_jobs()[0]}
    assert listed[job.id] == {**REQUEST, "calibration": {"steps": 3}, "include": ["model.layers.*"]}
    assert listed[plain.id] == REQUEST  # nothing to leave out: the request as it was
    assert store.get_job(job.id).request["calibration"]["texts"] == texts


def test_idempotency_key_returns_the_same_job_or_conflicts(env) -> None:
    store, _, _ = env
    first, created = store.create_job(REQUEST, request_hash="a", idempotency_key="k1")
    again, created_again = store.create_job(REQUEST, request_hash="a", idempotency_key="k1")
    assert created and not created_again and again.id == first.id
    with pytest.raises(IdempotencyConflict):
        store.create_job(REQUEST, request_hash="b", idempotency_key="k1")
    assert len(store.list_jobs()[0]) == 1


def test_concurrent_claims_take_each_job_exactly_once(env) -> None:
    store, url, prefix = env
    jobs = _submit(store, 12)
    claimed: list[str] = []
    lock = threading.Lock()

    def claim_all() -> None:
        own = JobStore(url, table_prefix=prefix)  # its own engine and connections, like another host
        wid = WorkerRegistry.new_id()
        try:
            while (job := own.claim_next(wid)) is not None:
                with lock:
                    claimed.append(job.id)
        finally:
            own.close()

    threads = [threading.Thread(target=claim_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Counter(claimed) == Counter(j.id for j in jobs)
    assert all(j.status is JobStatus.RUNNING and j.attempt == 1 for j in store.list_jobs(limit=20)[0])


def test_claim_is_oldest_first_and_empty_queue_gives_none(env) -> None:
    store, _, _ = env
    jobs = _submit(store, 2)
    assert store.claim_next("w").id == jobs[0].id
    assert store.claim_next("w").id == jobs[1].id
    assert store.claim_next("w") is None


def test_status_changes_follow_the_table_and_the_owner(env) -> None:
    store, _, _ = env
    (job,) = _submit(store)
    running = store.claim_next("w1")
    with pytest.raises(JobLost):
        store.set_status(job.id, JobStatus.SUCCEEDED, owner="w2")
    done = store.set_status(job.id, JobStatus.SUCCEEDED, owner="w1", artifacts=[{"name": "a", "bytes": 1}])
    assert running.status is JobStatus.RUNNING
    assert done.status is JobStatus.SUCCEEDED and done.finished_at is not None and done.progress == 1.0
    with pytest.raises(InvalidTransition):
        store.set_status(job.id, JobStatus.CANCELLING)
    kinds = [(e.kind, e.data.get("status")) for e in store.events.after(job.id)]
    assert kinds == [("status", "queued"), ("status", "running"), ("status", "succeeded")]


def test_heartbeat_reports_cancel_and_loss(env) -> None:
    store, _, _ = env
    (job,) = _submit(store)
    store.claim_next("w1")
    assert store.heartbeat_job(job.id, "w1", stage=Stage.CALIBRATE, done=3, total=10) is JobStatus.RUNNING
    progressed = store.get_job(job.id)
    assert (progressed.stage, progressed.stage_done, progressed.stage_total) == (Stage.CALIBRATE, 3, 10)
    # of the stages a conversion without a plan runs: resolve ... export and quality
    assert progressed.progress == pytest.approx((list(Stage).index(Stage.CALIBRATE) + 0.3) / (len(Stage) - 1), abs=1e-4)
    store.set_status(job.id, JobStatus.CANCELLING)
    assert store.heartbeat_job(job.id, "w1") is JobStatus.CANCELLING
    assert store.heartbeat_job(job.id, "someone-else") is None


def test_stale_jobs_are_requeued_then_failed_after_the_last_attempt(env, tmp_path: Path) -> None:
    store, _, _ = env
    dirs = ArtifactDirs(tmp_path / "jobs")
    (job,) = _submit(store, max_attempts=2)
    store.claim_next("dead-worker")
    time.sleep(0.15)
    assert reap_stale(store, dirs, timeout_s=0.1) == [(job.id, JobStatus.QUEUED)]
    requeued = store.get_job(job.id)
    assert requeued.status is JobStatus.QUEUED and requeued.worker_id is None
    assert store.claim_next("dead-again").attempt == 2
    staging = dirs.staging_dir(job.id, 2)
    staging.mkdir(parents=True)
    (staging / "half.safetensors").write_bytes(b"x")
    time.sleep(0.15)
    assert reap_stale(store, dirs, timeout_s=0.1) == [(job.id, JobStatus.FAILED)]
    failed = store.get_job(job.id)
    assert failed.error_code == "worker_lost" and "attempt 2 of 2" in failed.error_message
    assert not staging.exists()


def test_fresh_heartbeats_are_not_reaped(env, tmp_path: Path) -> None:
    store, _, _ = env
    (job,) = _submit(store)
    store.claim_next("w")
    assert reap_stale(store, ArtifactDirs(tmp_path / "jobs"), timeout_s=30) == []
    assert store.get_job(job.id).status is JobStatus.RUNNING


def test_stale_cancelling_job_ends_cancelled(env, tmp_path: Path) -> None:
    store, _, _ = env
    (job,) = _submit(store)
    store.claim_next("w")
    store.set_status(job.id, JobStatus.CANCELLING)
    time.sleep(0.15)
    assert reap_stale(store, ArtifactDirs(tmp_path / "jobs"), timeout_s=0.1) == [(job.id, JobStatus.CANCELLED)]


def test_delete_only_finished_jobs_and_their_events(env) -> None:
    store, _, _ = env
    job, other = _submit(store, 2)
    with pytest.raises(InvalidTransition):
        store.delete_job(job.id)
    store.set_status(job.id, JobStatus.CANCELLED)
    store.delete_job(job.id)
    with pytest.raises(JobNotFound):
        store.get_job(job.id)
    assert store.events.after(job.id) == []
    assert store.get_job(other.id).status is JobStatus.QUEUED


def test_workers_and_stage_timings_feed_metrics(env) -> None:
    store, _, _ = env
    store.workers.heartbeat("w1")
    store.workers.heartbeat("w2", job_id="j")
    store.workers.remove("w1")
    assert [w["id"] for w in store.workers.live(timeout_s=30)] == ["w2"]
    store.timings.record("j", [("calibrate", 1.5), ("export", 0.5)])
    store.timings.record("k", [("calibrate", 2.5)])
    assert store.timings.stats() == {"calibrate": (2, 4.0), "export": (1, 0.5)}
    assert store.count_by_status()[JobStatus.QUEUED] == 0


def test_heartbeats_are_judged_by_the_database_clock(env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import service.store.job_store

    store, _, _ = env
    dirs = ArtifactDirs(tmp_path / "jobs")
    behind, ahead = _submit(store, 2)
    real_time = time.time

    def worker_host_clock(offset_s: float) -> None:  # the worker's host clock is off by an hour
        monkeypatch.setattr(service.store.job_store, "time", types.SimpleNamespace(time=lambda: real_time() + offset_s))

    worker_host_clock(-3600)
    store.claim_next("slow-clock")
    assert store.heartbeat_job(behind.id, "slow-clock") is JobStatus.RUNNING
    store.workers.heartbeat("slow-clock")
    worker_host_clock(+3600)
    store.claim_next("fast-clock")
    assert store.heartbeat_job(ahead.id, "fast-clock") is JobStatus.RUNNING
    monkeypatch.undo()

    # a fresh heartbeat from a host whose clock is behind is not "an hour old" ...
    assert reap_stale(store, dirs, timeout_s=30) == []
    assert {w["id"] for w in store.workers.live(timeout_s=30)} == {"slow-clock"}
    # ... and a silent worker whose clock runs ahead is still found out
    time.sleep(0.5)
    assert (ahead.id, JobStatus.QUEUED) in reap_stale(store, dirs, timeout_s=0.25)


def test_the_reaper_keeps_a_job_that_heartbeats_after_it_was_found_stale(
        env, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store, _, _ = env
    (job,) = _submit(store)
    store.claim_next("w")
    time.sleep(1.2)
    find_stale = store.find_stale

    def racing_heartbeat(timeout_s: float) -> list:
        found = find_stale(timeout_s)
        assert [j.id for j in found] == [job.id]
        assert store.heartbeat_job(job.id, "w") is JobStatus.RUNNING  # the worker answers just in time
        return found

    monkeypatch.setattr(store, "find_stale", racing_heartbeat)
    assert reap_stale(store, ArtifactDirs(tmp_path / "jobs"), timeout_s=1.0) == []
    kept = store.get_job(job.id)
    assert (kept.status, kept.worker_id, kept.attempt) == (JobStatus.RUNNING, "w", 1)
    assert [e.data["status"] for e in store.events.after(job.id)] == ["queued", "running"]


def test_a_lost_worker_can_neither_write_events_nor_heartbeat_into_the_next_attempt(env) -> None:
    store, _, _ = env
    (job,) = _submit(store)
    store.claim_next("w1")
    assert store.events.add(job.id, "stage", {"stage": "calibrate"}, worker_id="w1", attempt=1)
    store.set_status(job.id, JobStatus.QUEUED, owner="w1", worker_id=None)
    assert store.claim_next("w2").attempt == 2

    assert not store.events.add(job.id, "warning", {"message": "late"}, worker_id="w1", attempt=1)
    assert not store.events.add(job.id, "warning", {"message": "late"}, worker_id="w1")
    assert not store.events.add(job.id, "warning", {"message": "wrong attempt"}, worker_id="w2", attempt=1)
    assert store.heartbeat_job(job.id, "w1") is None and store.heartbeat_job(job.id, "w2", attempt=1) is None
    assert store.events.add(job.id, "stage", {"stage": "resolve"}, worker_id="w2", attempt=2)
    with pytest.raises(JobLost):
        store.set_status(job.id, JobStatus.FAILED, owner="w2", owner_attempt=1)
    kinds = [(e.kind, e.data.get("status") or e.data.get("stage")) for e in store.events.after(job.id)]
    assert kinds == [("status", "queued"), ("status", "running"), ("stage", "calibrate"), ("status", "queued"),
                     ("status", "running"), ("stage", "resolve")]


def test_a_failing_before_commit_leaves_the_job_as_it_was(env) -> None:
    store, _, _ = env
    (job,) = _submit(store)
    store.claim_next("w")

    def publish(_conn) -> None:
        raise FileExistsError("the final directory is in the way")

    with pytest.raises(FileExistsError):
        store.set_status(job.id, JobStatus.SUCCEEDED, owner="w", owner_attempt=1, before_commit=publish,
                         artifacts=[{"name": "a", "bytes": 1}])
    again = store.get_job(job.id)
    assert again.status is JobStatus.RUNNING and again.artifacts == ()
    assert [e.data["status"] for e in store.events.after(job.id)] == ["queued", "running"]
