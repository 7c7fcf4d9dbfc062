"""A requantize job over two worker hosts that share only PostgreSQL and the object store (moto's real HTTP
server): each shard task uploads its shard, the finish task its own files, and the job's row publishes them.

kill -9 of the worker holding a shard task: that shard alone runs again (on the other host), the job succeeds
once, and the bucket holds exactly the published files, byte for byte those of `convert_model_free` run here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from service.jobs import TaskStatus
from service.store import JobStore
from tests.object_store_server import AWS_ENV, bucket_keys, moto_server, new_bucket, s3_settings, unfinished_uploads
from tests.service.test_requantize_jobs import (  # noqa: F401 - the module's sharded model fixture
    _finished,
    model_dir,
)
from tests.service.workers.test_multi_host import WorkerHost, fresh_database
from tests.service_helpers import freeze_worker, kill_9_frozen_worker, live_app, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

TIMEOUT_S = 5.0


def test_kill_9_on_one_host_redoes_its_shard_and_the_bucket_holds_the_published_files(
        tmp_path: Path, model_dir: Path) -> None:  # noqa: F811 - the fixture imported above
    from converters.modelfree import convert_model_free

    convert_model_free(model_dir, tmp_path / "local", "fp8-block")
    expected = {path.name: path.read_bytes() for path in (tmp_path / "local").iterdir()}
    with fresh_database() as db_url, moto_server(tmp_path / "moto.log") as moto, \
            pytest.MonkeyPatch.context() as mp:
        for name, value in AWS_ENV.items():
            mp.setenv(name, value)
        bucket = new_bucket(moto)
        api = s3_settings(tmp_path / "api-host", moto.endpoint, bucket, database_url=db_url,
                          heartbeat_interval_s=0.5, heartbeat_timeout_s=TIMEOUT_S,
                          allowed_model_roots=(model_dir.parent,))
        JobStore(db_url).close()
        env = {**AWS_ENV, "FP8FORGE_DATABASE_URL": db_url, "FP8FORGE_ARTIFACT_STORE": "s3",
               "FP8FORGE_S3_BUCKET": bucket, "FP8FORGE_S3_ENDPOINT_URL": moto.endpoint,
               "FP8FORGE_S3_PREFIX": "fp8forge", "FP8FORGE_HF_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "FP8FORGE_ALLOWED_MODEL_ROOTS": str(model_dir.parent), "FP8FORGE_CONVERSION_THREADS": "1",
               "FP8FORGE_HEARTBEAT_INTERVAL_S": "0.5", "FP8FORGE_HEARTBEAT_TIMEOUT_S": str(TIMEOUT_S),
               "FP8FORGE_POLL_INTERVAL_S": "0.2", "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
        hosts = [WorkerHost(tmp_path / f"host-{n}", env).start() for n in (1, 2)]
        store = JobStore(db_url)
        try:
            with live_app(api) as client:
                wait_for(lambda: len(store.workers.live(30)) == 2, timeout=60, what="two worker heartbeats")
                job_id = client.post("/v1/jobs", json={"model": str(model_dir),
                                                       "requantize": {"to": "fp8-block"}}).json()["id"]
                task = wait_for(lambda: next((t for t in store.tasks.of_job(job_id, kind="write")
                                              if t.status is TaskStatus.RUNNING), None),
                                timeout=120, what="a running write task", interval=0.02)
                victim = next(h for h in hosts if h.pid == int(task.worker_id.split(":")[1]))
                children = freeze_worker(victim.pid)  # it records nothing more, so it holds the task
                held = next(t for t in store.tasks.of_job(job_id) if t.seq == task.seq)
                assert held.status is TaskStatus.RUNNING and held.worker_id == task.worker_id
                kill_9_frozen_worker(victim.pid, children)
                victim.proc.wait()

                done = wait_for(lambda: _finished(client, job_id), timeout=300, what="the job to finish")
                logs = "\n".join(h.tail() for h in hosts)
                assert done["status"] == "succeeded", (done, logs)
                tasks = store.tasks.of_job(job_id)
                attempts = {t.seq: t.attempt for t in tasks}
                assert attempts.pop(task.seq) == 2
                assert set(attempts.values()) == {1}
                statuses = [e.data["status"] for e in store.events.after(job_id) if e.kind == "status"]
                assert statuses.count("succeeded") == 1

                listing = client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]
                published = {entry["name"]: client.get(entry["url"]).content for entry in listing}
                assert sorted(published) == sorted(expected)
                assert [name for name in expected if published[name] != expected[name]] == []
                job = store.get_job(job_id)
                assert sorted(bucket_keys(moto, bucket)) == sorted(
                    f"fp8forge/jobs/{job_id}/a{job.attempt}/{name}" for name in expected)
                assert unfinished_uploads(moto, bucket) == []
        finally:
            for host in hosts:
                host.stop()
            store.close()
