"""A full disk is an infrastructure failure, not the job's nor a bug.

Real small file systems (a tmpfs of a few KiB, mounted by the test: it needs root, and is skipped without):
a worker whose disk fills up during the conversion has the job retried, and a worker with room finishes it; a
SQLite store on a full disk answers ``POST /v1/jobs`` with 503 and ``Retry-After``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from service.config import Settings
from service.jobs import JobStatus
from service.workers.worker import Worker
from tests.models import save_tiny_model
from tests.service_helpers import live_app

BODY = {"model": "demo/tiny-llama", "recipe": {"backend": "ao", "recipe_name": "tensorwise"},
        "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}


@contextlib.contextmanager
def small_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` for the test's duration."""
    path.mkdir(parents=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def fill(directory: Path) -> Path:
    """Write one file until the file system is full; returns it."""
    filler = directory / "filler"
    with filler.open("wb", buffering=0) as handle:  # unbuffered: nothing is left to fail again on close
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    return filler


@pytest.mark.slow
def test_a_worker_out_of_disk_space_leaves_the_job_to_one_with_room(tmp_path: Path) -> None:
    model = save_tiny_model("llama", tmp_path / "models" / "llama")
    shared = {"database_url": f"sqlite:///{tmp_path / 'shared.db'}", "allowed_model_roots": (model.parent,),
              "hf_offline": True, "conversion_threads": 1}
    with small_filesystem(tmp_path / "small-disk", "64k") as small:
        full_host = Worker(Settings(data_dir=small, **shared))
        roomy_host = Worker(Settings(data_dir=tmp_path / "roomy", **shared))
        try:
            job, _ = full_host.store.create_job({**BODY, "model": str(model)}, request_hash="h")
            assert full_host.run_once()
            retried = full_host.store.get_job(job.id)
            assert retried.status is JobStatus.QUEUED and retried.attempt == 1, (retried.error_code,
                                                                                retried.error_message)
            (requeued,) = [e.data for e in full_host.store.events.after(job.id) if e.data.get("reason")]
            assert requeued["reason"] == "disk_full" and "disk" in requeued["message"], requeued
            assert "attempt 1 of 3" in requeued["message"]
            assert list((small / "jobs").iterdir()) == []  # its partial files are gone, the room with them

            assert roomy_host.run_once()
            done = roomy_host.store.get_job(job.id)
            assert done.status is JobStatus.SUCCEEDED and done.attempt == 2, (done.error_code, done.error_message)
            assert done.worker_id == roomy_host.worker_id
        finally:
            full_host.store.close()
            roomy_host.store.close()


def test_a_full_disk_under_the_sqlite_store_answers_503_with_retry_after(tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "small-disk", "8m") as small:
        settings = Settings(data_dir=small, auth_disabled=True, workers=0, hf_offline=True)
        with live_app(settings) as client:
            assert client.post("/v1/jobs", json=BODY).status_code == 202
            filler = fill(small)
            texts = {**BODY, "calibration": {**BODY["calibration"], "texts": ["x" * 100_000]}}
            refused = client.post("/v1/jobs", json=texts)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "disk_full"
            assert "disk" in refused.json()["error"]["message"]
            assert int(refused.headers["Retry-After"]) > 0
            filler.unlink()
            assert client.post("/v1/jobs", json=texts).status_code == 202  # room again: accepted again
