"""Artifacts in an S3-compatible object store (moto's real HTTP server on loopback, started here).

A real job of the demo model by a real worker lands in the bucket under its attempt's prefix and downloads
through the API (streamed with Range, ETag and HEAD; or redirected to a pre-signed URL); DELETE removes the
objects. Uploads cut half-way (the store goes away mid-part), and files whose bytes differ from their recorded
sha256, publish nothing; the job is retried or fails with ``artifact_upload_failed``; the sweeper removes the
attempt prefixes no job points at.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.artifacts.s3 import ObjectArtifacts
from service.config import SettingsError, load_settings
from service.jobs import JobStatus
from service.store import JobStore
from service.workers.messages import StageStarted, Succeeded
from service.workers.reaper import sweep_orphans
from service.workers.worker import Worker
from tests.object_store_server import (
    AWS_ENV,
    CuttingProxy,
    bucket_keys,
    moto_server,
    new_bucket,
    s3_settings,
    unfinished_uploads,
)
from tests.service_helpers import leftovers, live_app

pytestmark = pytest.mark.slow  # spawns processes or servers: seconds each

BIG = 12 << 20  # three 5 MiB-or-less parts


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory):
    with pytest.MonkeyPatch.context() as mp:
        for name, value in AWS_ENV.items():
            mp.setenv(name, value)
        with moto_server(tmp_path_factory.mktemp("moto") / "moto.log") as server:
            yield server


def sized_child(request: dict[str, Any], out_dir: str, sources: dict[str, Any], conn: Any, stop: Any,
                worker_pid: int, **_: Any) -> None:
    """Stands in for the conversion child: writes ``request["size"]`` bytes of model and a manifest that lists
    them with ``request["claimed_sha256"]`` when given (a file that changed after it was listed)."""
    from service.workers.procs import die_with_worker

    die_with_worker(worker_pid)
    out = Path(out_dir)
    staging = out.parent / f".{out.name}.partial"
    staging.mkdir()
    conn.send(StageStarted("export"))
    data = bytes(range(256)) * (request["size"] // 256)
    (staging / "model.safetensors").write_bytes(data)
    (staging / "manifest.json").write_text(json.dumps({"files": []}))
    os.replace(staging, out)
    sha = request.get("claimed_sha256") or hashlib.sha256(data).hexdigest()
    conn.send(Succeeded([{"name": "model.safetensors", "bytes": len(data), "sha256": sha}]))
    conn.close()


def _submit(worker: Worker, *, max_attempts: int, **request: Any):
    job, _ = worker.store.create_job({"model": "fake", **request}, request_hash=os.urandom(8).hex(),
                                     max_attempts=max_attempts)
    return job


def _prefix(job_id: str, attempt: int) -> str:
    return f"fp8forge/jobs/{job_id}/a{attempt}/"


def test_a_real_job_lands_in_the_store_and_downloads_through_the_api(moto, tmp_path: Path) -> None:
    bucket = new_bucket(moto)
    db = f"sqlite:///{tmp_path / 'jobs.db'}"
    # the worker and the API share the database and the bucket, never a directory
    worker = Worker(s3_settings(tmp_path / "worker-host", moto.endpoint, bucket, database_url=db))
    api = s3_settings(tmp_path / "api-host", moto.endpoint, bucket, database_url=db)
    body = {"model": "demo/tiny-llama", "recipe": {"backend": "ao", "recipe_name": "tensorwise"},
            "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16},
            "serving_formats": ["compressed-tensors-fp8"]}  # files in a sub-folder too
    with live_app(api) as client:
        job_id = client.post("/v1/jobs", json=body).json()["id"]
        assert worker.run_once()
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded", job
        listing = {a["name"]: a for a in client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]}
        nested = "serving/compressed-tensors-fp8/model.safetensors"
        assert {"model.safetensors", "manifest.json", "fp8_report.json", nested} <= set(listing)

        # the objects are the listing, under attempt 1's prefix, with the recorded sha256 as metadata
        assert bucket_keys(moto, bucket) == sorted(_prefix(job_id, 1) + name for name in listing)
        s3 = moto.client()
        model_key = _prefix(job_id, 1) + "model.safetensors"
        assert s3.head_object(Bucket=bucket, Key=model_key)["Metadata"]["sha256"] == listing["model.safetensors"][
            "sha256"]
        assert leftovers(worker.settings.jobs_dir) == [] and not (worker.settings.jobs_dir / job_id).exists()
        assert not (api.jobs_dir / job_id).exists()

        for name, entry in listing.items():
            got = client.get(entry["url"])
            assert got.status_code == 200 and got.headers["etag"] == f'"{entry["sha256"]}"'
            assert hashlib.sha256(got.content).hexdigest() == entry["sha256"], name
        model = listing["model.safetensors"]
        url, etag, size = model["url"], f'"{model["sha256"]}"', model["bytes"]
        head = client.head(url)
        assert head.status_code == 200 and head.headers["content-length"] == str(size) and not head.content
        assert head.headers["etag"] == etag and "last-modified" in head.headers
        first = client.get(url, headers={"Range": "bytes=0-99999"})
        rest = client.get(url, headers={"Range": "bytes=100000-", "If-Range": etag})
        assert (first.status_code, rest.status_code) == (206, 206)
        assert rest.headers["content-range"] == f"bytes 100000-{size - 1}/{size}"
        assert hashlib.sha256(first.content + rest.content).hexdigest() == model["sha256"]
        assert client.get(url, headers={"Range": "bytes=0-9", "If-Range": '"stale"'}).status_code == 200
        refused = client.get(url, headers={"Range": f"bytes={size}-"})
        assert refused.status_code == 416 and refused.headers["content-range"] == f"bytes */{size}"

        with live_app(s3_settings(tmp_path / "api-2", moto.endpoint, bucket, database_url=db,
                                  artifact_downloads="redirect")) as redirecting:
            moved = redirecting.get(url, headers={"Range": "bytes=10-19"})
            assert moved.status_code == 307 and moved.headers["location"].startswith(moto.endpoint)
            direct = httpx.get(moved.headers["location"], headers={"Range": "bytes=10-19"})
            assert direct.status_code == 206 and direct.content == first.content[10:20]
            whole = redirecting.get(url, follow_redirects=True)
            assert hashlib.sha256(whole.content).hexdigest() == model["sha256"]
            assert redirecting.head(url).headers["etag"] == etag  # HEAD is answered by the API

        assert client.delete(f"/v1/jobs/{job_id}").status_code == 204
        assert bucket_keys(moto, bucket) == []
        assert client.get(url).status_code == 404
    worker.store.close()


@pytest.fixture
def cut_worker(moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A worker whose store is reached through a proxy that can cut it off; runs ``sized_child``."""
    monkeypatch.setattr("service.workers.runner.child_main", sized_child)
    bucket = new_bucket(moto)
    proxy = CuttingProxy(moto.port)
    worker = Worker(s3_settings(tmp_path / "data", proxy.endpoint, bucket))
    yield worker, proxy, bucket
    proxy.close()
    worker.store.close()


def test_an_upload_cut_half_way_publishes_nothing_and_the_next_attempt_does(moto, cut_worker) -> None:
    worker, proxy, bucket = cut_worker
    job = _submit(worker, max_attempts=2, size=BIG)
    proxy.cut_after(BIG // 2)  # the store goes away in the middle of the model's second part
    assert worker.run_once()
    assert proxy.is_cut.is_set()

    requeued = worker.store.get_job(job.id)
    assert requeued.status is JobStatus.QUEUED and requeued.artifacts == ()
    (event,) = [e.data for e in worker.store.events.after(job.id) if e.data.get("reason") == "artifact_upload_failed"]
    assert "model.safetensors" in event["message"] and "attempt 1 of 2" in event["message"]
    # nothing a reader could take for the model: at most the half-sent upload, never a complete object
    assert _prefix(job.id, 1) + "model.safetensors" not in bucket_keys(moto, bucket)

    proxy.heal()
    assert worker.run_once()
    done = worker.store.get_job(job.id)
    assert (done.status, done.attempt) == (JobStatus.SUCCEEDED, 2)
    # the second attempt removed what the first left (its objects and its unfinished upload)
    assert bucket_keys(moto, bucket) == [_prefix(job.id, 2) + n for n in ("manifest.json", "model.safetensors")]
    assert unfinished_uploads(moto, bucket) == []
    got = moto.client().get_object(Bucket=bucket, Key=_prefix(job.id, 2) + "model.safetensors")["Body"].read()
    assert hashlib.sha256(got).hexdigest() == next(a for a in done.artifacts if a["name"] == "model.safetensors")[
        "sha256"]
    assert leftovers(worker.settings.jobs_dir) == []


def test_the_last_attempt_fails_with_the_code_and_the_sweeper_clears_its_prefix(moto, cut_worker) -> None:
    worker, proxy, bucket = cut_worker
    job = _submit(worker, max_attempts=1, size=BIG)
    proxy.cut_after(BIG // 2)
    assert worker.run_once()
    failed = worker.store.get_job(job.id)
    assert failed.status is JobStatus.FAILED and failed.error_code == "artifact_upload_failed", failed
    assert failed.error_message == ("the object store refused or did not answer the upload of 'model.safetensors' "
                                    "(attempt 1 of 1)")
    assert "127.0.0.1" not in failed.error_message  # no host names reach the client
    assert failed.artifacts == ()
    assert unfinished_uploads(moto, bucket) != [] or bucket_keys(moto, bucket) != []  # the store was away

    proxy.heal()
    removed = sweep_orphans(worker.store, worker.dirs)
    assert {(r.job_id, r.attempt) for r in removed} == {(job.id, 1)}
    assert bucket_keys(moto, bucket) == [] and unfinished_uploads(moto, bucket) == []


@pytest.mark.parametrize("size", [4096, BIG], ids=["single-put", "multipart"])
def test_bytes_that_differ_from_the_recorded_sha256_are_never_published(moto, cut_worker, size: int) -> None:
    worker, _, bucket = cut_worker
    job = _submit(worker, max_attempts=1, size=size, claimed_sha256="0" * 64)
    assert worker.run_once()
    failed = worker.store.get_job(job.id)
    assert failed.status is JobStatus.FAILED and failed.error_code == "artifact_upload_failed"
    assert "does not match the sha256 recorded" in failed.error_message
    assert bucket_keys(moto, bucket) == [] and unfinished_uploads(moto, bucket) == []


def test_the_sweeper_keeps_only_what_a_job_row_points_at(moto, tmp_path: Path) -> None:
    bucket = new_bucket(moto)
    settings = s3_settings(tmp_path / "data", moto.endpoint, bucket)
    storage = ObjectArtifacts.from_settings(settings)
    store = JobStore(settings.store_url)
    s3 = moto.client()

    def job_at(status: JobStatus, attempts: int) -> str:
        job, _ = store.create_job({"model": "fake"}, request_hash=os.urandom(8).hex(), max_attempts=5)
        for n in range(attempts):
            store.claim_next("w")
            if n < attempts - 1:
                store.set_status(job.id, JobStatus.QUEUED, owner="w", worker_id=None)
        if status is not JobStatus.RUNNING:
            store.set_status(job.id, status, owner="w")
        return job.id

    succeeded, failed, running = job_at(JobStatus.SUCCEEDED, 2), job_at(JobStatus.FAILED, 1), job_at(
        JobStatus.RUNNING, 1)
    deleted = "d" * 32
    for job_id, attempt in ((succeeded, 1), (succeeded, 2), (failed, 1), (running, 1), (deleted, 3)):
        s3.put_object(Bucket=bucket, Key=_prefix(job_id, attempt) + "model.safetensors", Body=b"x")
    s3.create_multipart_upload(Bucket=bucket, Key=_prefix(failed, 1) + "big.bin")
    (storage.attempt_dir(succeeded, 2)).mkdir(parents=True)  # a worker killed between commit and clean-up

    removed = sweep_orphans(store, storage)
    assert sorted((r.job_id, r.attempt) for r in removed) == sorted(
        [(succeeded, 1), (succeeded, 2), (failed, 1), (deleted, 3)])  # the second (succeeded, 2) is the local dir
    assert bucket_keys(moto, bucket) == sorted(
        [_prefix(succeeded, 2) + "model.safetensors", _prefix(running, 1) + "model.safetensors"])
    assert unfinished_uploads(moto, bucket) == [] and leftovers(settings.jobs_dir) == []
    store.close()


def test_a_store_that_does_not_answer_is_503_for_downloads_and_stops_a_worker_at_start(
        moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from service.cli.serve import main
    from tests.service_helpers import publish_job

    bucket = new_bucket(moto)
    proxy = CuttingProxy(moto.port)
    settings = s3_settings(tmp_path / "data", proxy.endpoint, bucket)
    store = JobStore(settings.store_url)
    job = publish_job(store, tmp_path / "unused", {"model.safetensors": b"abc"})
    proxy.cut()
    with live_app(settings) as client:
        started = time.monotonic()
        answer = client.get(f"/v1/jobs/{job.id}/artifacts/model.safetensors")
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "artifact_store_unavailable"
        assert answer.headers["retry-after"] == "5" and time.monotonic() - started < 30
    store.close()

    for name, value in {"FP8FORGE_DATA_DIR": str(tmp_path / "w"), "FP8FORGE_ARTIFACT_STORE": "s3",
                        "FP8FORGE_S3_BUCKET": "no-such-bucket", "FP8FORGE_S3_ENDPOINT_URL": moto.endpoint}.items():
        monkeypatch.setenv(name, value)
    assert main(["worker"]) == 2


def test_the_object_store_needs_a_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FP8FORGE_ARTIFACT_STORE", "s3")
    with pytest.raises(SettingsError, match="FP8FORGE_S3_BUCKET"):
        load_settings()
    monkeypatch.setenv("FP8FORGE_S3_BUCKET", "artifacts")
    monkeypatch.setenv("FP8FORGE_S3_PREFIX", "/team/fp8/")
    assert load_settings().s3_prefix == "team/fp8/"



@pytest.fixture
def slow_worker(moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A worker whose every file upload starts late (a slow link; ``worker.upload_began`` lists when), with a
    heartbeat timeout of 1 s and ``sized_child`` as its conversion; ``worker.proxy`` counts the bytes sent."""
    import service.artifacts.s3 as s3_module

    monkeypatch.setattr("service.workers.runner.child_main", sized_child)
    proxy = CuttingProxy(moto.port)
    worker = Worker(s3_settings(tmp_path / "data", proxy.endpoint, new_bucket(moto), heartbeat_timeout_s=1.0))
    worker.proxy = proxy
    real, worker.upload_began = s3_module.put_file, []

    def late(*args: Any, **kwargs: Any) -> None:
        worker.upload_began.append(time.monotonic())
        time.sleep(1.2)
        real(*args, **kwargs)

    monkeypatch.setattr(s3_module, "put_file", late)
    yield worker
    proxy.close()
    worker.store.close()


def test_an_upload_longer_than_the_heartbeat_timeout_keeps_its_job(moto, slow_worker) -> None:
    import threading

    from service.workers.reaper import reap_stale

    worker = slow_worker
    job = _submit(worker, max_attempts=2, size=4096)  # two files: more than twice the timeout in all
    stop = threading.Event()

    def reaper() -> None:  # what the API and other workers do meanwhile
        while not stop.wait(0.1):
            reap_stale(worker.store, worker.dirs, worker.settings.heartbeat_timeout_s)

    thread = threading.Thread(target=reaper)
    thread.start()
    try:
        assert worker.run_once()
    finally:
        stop.set()
        thread.join()
    done = worker.store.get_job(job.id)
    assert (done.status, done.attempt) == (JobStatus.SUCCEEDED, 1)
    assert not any(e.data.get("reason") == "worker_lost" for e in worker.store.events.after(job.id))
    assert len(bucket_keys(moto, worker.dirs.bucket)) == 2


def test_a_cancel_during_the_upload_stops_it_and_publishes_nothing(moto, slow_worker) -> None:
    import threading

    worker = slow_worker
    job = _submit(worker, max_attempts=2, size=BIG)

    def cancel_once_uploading() -> None:
        while not worker.upload_began:
            time.sleep(0.02)
        worker.store.set_status(job.id, JobStatus.CANCELLING)

    thread = threading.Thread(target=cancel_once_uploading)
    thread.start()
    assert worker.run_once()
    thread.join()
    assert worker.store.get_job(job.id).status is JobStatus.CANCELLED
    assert worker.proxy.forwarded < BIG // 2  # the model's parts were never sent
    assert bucket_keys(moto, worker.dirs.bucket) == [] and unfinished_uploads(moto, worker.dirs.bucket) == []
    assert leftovers(worker.settings.jobs_dir) == []
