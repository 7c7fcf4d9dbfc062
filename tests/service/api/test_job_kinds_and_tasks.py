"""Every job kind in the API, which worker ran which task, and a job's files in one download; over real HTTP
(uvicorn on loopback) with a real SQLite store driven as workers drive it (no worker processes)."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from service.api.auth import key_entry
from service.config import Settings
from service.jobs import JobStatus, TaskStatus, public_worker_name
from service.store import JobStore
from service.store.host_faults import public_host_name
from tests.service_helpers import live_app, publish_job

CALIBRATED = {"model": "demo/tiny-llama", "recipe": {"backend": "ao"}}
TOKENS = {"alice": "fp8f_alice-tasks", "root": "fp8f_root-tasks"}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    (tmp_path / "models").mkdir()
    return Settings(data_dir=tmp_path / "data", auth_disabled=True, allowed_model_roots=(tmp_path / "models",),
                    workers=0)


@pytest.fixture
def client(settings: Settings):
    with live_app(settings) as client:
        yield client


@pytest.fixture
def store(settings: Settings, client):
    store = JobStore(settings.store_url)
    yield store
    store.close()


def _submit(client, body: dict) -> dict:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return response.json()


def test_each_job_kind_is_named_in_its_body_and_in_the_list(client) -> None:
    calibrated = _submit(client, CALIBRATED)
    plan = _submit(client, {**CALIBRATED, "plan": {"target_kl": 0.05}})
    requantize = _submit(client, {"model": "demo/tiny-llama", "requantize": {"to": "fp8-block"}})
    assert (calibrated["kind"], plan["kind"], requantize["kind"]) == ("calibrated", "plan", "requantize")
    listed = {job["id"]: job["kind"] for job in client.get("/v1/jobs").json()["data"]}
    assert listed == {calibrated["id"]: "calibrated", plan["id"]: "plan", requantize["id"]: "requantize"}


def test_a_requantize_jobs_report_link_is_its_requantize_report(client, store, settings) -> None:
    from service.api.schemas import REQUANTIZE_REPORT

    files = {REQUANTIZE_REPORT: b'{"format": "fp8-block"}', "model.safetensors": b"\0" * 64}
    job = publish_job(store, settings.jobs_dir, files)
    body = client.get(f"/v1/jobs/{job.id}").json()
    # publish_job's request is a calibrated one; the link follows the file the job published
    assert body["links"]["report"] == f"/v1/jobs/{job.id}/artifacts/{REQUANTIZE_REPORT}"
    assert client.get(body["links"]["report"]).json() == {"format": "fp8-block"}


def test_the_requantize_report_name_is_the_converters_own() -> None:
    from converters.modelfree.driver import REPORT_NAME
    from service.api.schemas import REQUANTIZE_REPORT

    assert REQUANTIZE_REPORT == REPORT_NAME


def _split_job(store: JobStore, job_id: str, shards: list[str]) -> None:
    """Drive a claimed requantize job as workers do: the plan task, then one write task per shard."""
    job = store.claim_next("host-a:101")
    assert job is not None and job.id == job_id
    assert store.tasks.split(job_id, "host-a:101", job.attempt, source="demo/tiny-llama", payload={},
                             max_attempts=2)
    plan = store.tasks.claim("host-a:101", "host-a")
    writes = [{"kind": "write", "shard": shard, "phase": 1, "payload": {}} for shard in shards]
    assert store.tasks.succeed(plan, "host-a:101", {}, new_tasks=writes)


def test_tasks_say_which_worker_and_host_ran_each_shard_its_attempt_state_and_times(client, store) -> None:
    job = _submit(client, {"model": "demo/tiny-llama", "requantize": {"to": "fp8-block"}})
    assert client.get(f"/v1/jobs/{job['id']}/tasks").json() == {"data": [], "count": 0}  # queued: no task yet
    _split_job(store, job["id"], ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    first = store.tasks.claim("host-b:202", "host-b")
    time.sleep(0.05)
    assert store.tasks.succeed(first, "host-b:202", {"bytes": 1})
    second = store.tasks.claim("host-a:101", "host-a")
    # the worker lost it: requeued as a new attempt, then claimed and failed by another
    assert store.tasks.release(second, TaskStatus.QUEUED, worker_id="host-a:101")
    second = store.tasks.claim("host-b:202", "host-b")
    assert store.tasks.release(second, TaskStatus.FAILED, worker_id="host-b:202",
                               error=("conversion_failed", "shard 2: disk full\nsecond line"))

    answer = client.get(f"/v1/jobs/{job['id']}/tasks")
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["count"] == 3
    plan, one, two = body["data"]
    assert (plan["name"], plan["kind"], plan["shard"]) == ("plan", "plan", None)
    assert plan["worker"] == public_worker_name("host-a:101") and plan["host"] == "host-a"
    assert (one["name"], one["kind"], one["status"], one["attempt"]) == (
        "model-00001-of-00002.safetensors", "write", "succeeded", 1)
    assert one["worker"] == public_worker_name("host-b:202") and one["host"] == "host-b"
    assert one["started_at"] and one["finished_at"] and one["seconds"] >= 0.05
    assert (two["status"], two["attempt"], two["max_attempts"]) == ("failed", 2, 2)
    assert two["error"] == {"code": "conversion_failed", "message": "shard 2: disk full\nsecond line"}
    assert "payload" not in two and "result" not in two


def test_tasks_of_a_job_not_split_are_an_empty_list_and_an_unknown_job_is_404(client) -> None:
    job = _submit(client, CALIBRATED)
    assert client.get(f"/v1/jobs/{job['id']}/tasks").json() == {"data": [], "count": 0}
    missing = client.get(f"/v1/jobs/{uuid.uuid4().hex}/tasks")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"


def test_a_host_name_is_shown_to_admins_and_an_opaque_one_to_others(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", workers=0, api_keys=(
        key_entry("alice", "user", TOKENS["alice"]), key_entry("root", "admin", TOKENS["root"])))
    with live_app(settings) as client:
        alice = {"Authorization": f"Bearer {TOKENS['alice']}"}
        job = client.post("/v1/jobs", json={"model": "demo/tiny-llama", "requantize": {"to": "fp8-block"}},
                          headers=alice).json()
        store = JobStore(settings.store_url)
        try:
            _split_job(store, job["id"], ["model.safetensors"])
        finally:
            store.close()
        mine = client.get(f"/v1/jobs/{job['id']}/tasks", headers=alice).json()["data"]
        admin = client.get(f"/v1/jobs/{job['id']}/tasks",
                           headers={"Authorization": f"Bearer {TOKENS['root']}"}).json()["data"]
    assert [t["worker"] for t in mine] == [public_worker_name("host-a:101"), None]
    # which machines run the service is the operator's to know; others see which tasks shared a host
    assert [t["host"] for t in mine] == [public_host_name("host-a"), None]
    assert [t["host"] for t in admin] == ["host-a", None]


FILES = {"model.safetensors": os.urandom(2_500_000), "fp8_report.json": b'{"converted": 14}', "config.json": b"{}",
         "serving/compressed-tensors-fp8/model.safetensors": os.urandom(1024),
         "serving/compressed-tensors-fp8/a-rather-long-file-name-" + "x" * 90 + ".json": b"[1, 2]"}


def _publish_tree(store: JobStore, jobs_dir: Path, files: dict[str, bytes]):
    """publish_job for files in subdirectories too (a serving export's serving/<format>/...)."""
    from service.artifacts import ArtifactDirs

    job, _ = store.create_job({"model": "demo/tiny-llama"}, request_hash=uuid.uuid4().hex)
    store.claim_next("test-worker")
    dirs = ArtifactDirs(jobs_dir)
    for name, data in files.items():
        (dirs.final_dir(job.id) / name).parent.mkdir(parents=True, exist_ok=True)
        (dirs.final_dir(job.id) / name).write_bytes(data)
    return store.set_status(job.id, JobStatus.SUCCEEDED, owner="test-worker", artifacts=dirs.index(job.id))


def test_download_all_is_one_tar_of_the_jobs_own_files(client, store, settings) -> None:
    job = _publish_tree(store, settings.jobs_dir, FILES)
    other = publish_job(store, settings.jobs_dir, {"secret.bin": b"not job one's"})
    response = client.get(f"/v1/jobs/{job.id}/archive")
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-tar"
    assert response.headers["content-length"] == str(len(response.content))
    assert response.headers["content-disposition"] == f'attachment; filename="fp8forge-job-{job.id}.tar"'
    with tarfile.open(fileobj=io.BytesIO(response.content)) as archive:
        members = {m.name: archive.extractfile(m).read() for m in archive.getmembers() if m.isfile()}
    listed = {a["name"] for a in client.get(f"/v1/jobs/{job.id}/artifacts").json()["data"]}
    assert set(members) == {f"{job.id}/{name}" for name in listed}
    assert {name: members[f"{job.id}/{name}"] for name in FILES} == FILES
    assert not any("secret" in name for name in members) and other.id not in str(members)
    assert {a["name"]: a["sha256"] for a in job.artifacts} == {
        name: hashlib.sha256(members[f"{job.id}/{name}"]).hexdigest() for name in listed}


def test_the_archive_reads_the_same_in_any_piece_size(store, settings) -> None:
    from service.api.downloads import archive_response
    from service.artifacts import ArtifactDirs

    job = _publish_tree(store, settings.jobs_dir, FILES)
    whole = b"".join(_drain(archive_response(job, ArtifactDirs(settings.jobs_dir)), 1 << 20))
    odd = archive_response(job, ArtifactDirs(settings.jobs_dir))
    assert b"".join(_drain(odd, 777)) == whole and len(whole) == odd.length
    with tarfile.open(fileobj=io.BytesIO(whole)) as archive:
        assert {m.name.split("/", 1)[1]: archive.extractfile(m).read() for m in archive.getmembers()} == FILES


def _drain(response, size: int) -> list[bytes]:
    pieces, left = [], response.length
    while left:
        piece = response.read(min(size, left))
        assert piece, f"short body: {left} bytes missing"
        pieces.append(piece)
        left -= len(piece)
    response.close()
    return pieces


def test_download_all_of_an_unfinished_job_is_409_and_of_someone_elses_404(client, store, settings) -> None:
    job = _submit(client, CALIBRATED)
    answer = client.get(f"/v1/jobs/{job['id']}/archive")
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "invalid_transition"
    assert "succeeded" in answer.json()["error"]["message"]
    assert client.get(f"/v1/jobs/{uuid.uuid4().hex}/archive").status_code == 404
    store.set_status(job["id"], JobStatus.CANCELLED)
    assert client.get(f"/v1/jobs/{job['id']}/archive").status_code == 409
