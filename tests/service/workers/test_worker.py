"""The worker loop in-process against a real SQLite store, with the real spawned conversion child."""

from __future__ import annotations

from pathlib import Path

from service.api.schemas import JobCreate
from service.artifacts import ArtifactDirs
from service.config import Settings
from service.jobs import JobStatus
from service.workers.worker import Worker
from tests.service_helpers import leftovers


def _queue(worker: Worker, body: JobCreate):
    """Queue ``body`` as the API would once its checks passed (the API's own checks are tests/service/api's)."""
    job, _ = worker.store.create_job(body.to_request(), request_hash=body.model_dump_json(),
                                     max_attempts=worker.settings.max_attempts)
    return job


def test_a_failing_run_is_recorded_with_its_error_and_leaves_nothing(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    settings = Settings(data_dir=tmp_path / "data", allowed_model_roots=(models,), heartbeat_interval_s=0.5)
    worker = Worker(settings)
    # a model that was there when the job was queued and is gone when a worker runs it
    body = JobCreate(model=str(models / "not-there"), recipe={"backend": "ao"},
                     calibration={"steps": 1, "batch_size": 1, "seq_len": 8})
    job = _queue(worker, body)

    assert worker.run_once() is True
    failed = worker.store.get_job(job.id)
    assert failed.status is JobStatus.FAILED and failed.attempt == 1
    assert failed.error_code == "model_not_found" and "not-there" in failed.error_message, failed
    assert leftovers(settings.jobs_dir) == [] and not (settings.jobs_dir / job.id).exists()
    assert worker.run_once() is False  # nothing else queued; a failed run is not retried
    worker.store.close()


def test_stopping_a_worker_requeues_its_job_without_using_an_attempt(tmp_path: Path) -> None:
    import os
    import signal
    import threading

    from tests.service_helpers import build_tiny_llama, children_since, wait_for, work_children

    models = tmp_path / "models"
    build_tiny_llama(models / "tiny-llama")
    settings = Settings(data_dir=tmp_path / "data", allowed_model_roots=(models,), heartbeat_interval_s=0.2,
                        cancel_grace_s=0.2)
    worker = Worker(settings)
    body = JobCreate(model=str(models / "tiny-llama"), recipe={"backend": "ao"},
                     calibration={"steps": 50, "batch_size": 1, "seq_len": 16})
    job = _queue(worker, body)
    before = set(work_children(os.getpid()))
    thread = threading.Thread(target=worker.run)
    thread.start()
    staging = ArtifactDirs(settings.jobs_dir).staging_dir(job.id, 1)
    wait_for(staging.exists, timeout=60, what="the run to start staging files", interval=0.01)
    (child,) = children_since(os.getpid(), before)
    os.kill(child, signal.SIGSTOP)  # a run that does not answer: the worker must stop it by force

    worker.stop()
    thread.join(30)
    assert not thread.is_alive()
    requeued = worker.store.get_job(job.id)
    assert requeued.status is JobStatus.QUEUED and requeued.attempt == 0 and requeued.worker_id is None
    assert leftovers(settings.jobs_dir) == [] and not (settings.jobs_dir / job.id).exists()
    assert worker.store.workers.live(timeout_s=30) == []
    worker.store.close()
