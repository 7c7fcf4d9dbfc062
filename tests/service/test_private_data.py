"""A service started under the usual umask (022) keeps its data private: `fp8forge serve` (a real subprocess, SQLite,
one worker) creates its data dir and jobs dir 0700 and the database 0600, and every file of a requantize and of a
calibrated job's artifact is 0640 or stricter (directories 0750), a 0600 side file of the source included; before,
all of it was 0644/0755: any local user could read every tenant's calibration texts, reports and weights."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.service_helpers import ServeProcess, fp8forge_command, wait_for

pytestmark = pytest.mark.slow

JOBS = {"requantize": {"requantize": {"to": "fp8-block"}},
        "calibrated": {"recipe": {"backend": "te"}, "calibration": {"steps": 1, "seq_len": 8}}}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def _finished(client: httpx.Client, job_id: str) -> dict | None:
    job = client.get(f"/v1/jobs/{job_id}").json()
    return job if job["status"] in ("succeeded", "failed", "cancelled") else None


def test_a_service_under_umask_022_keeps_its_data_private(tmp_path: Path, llama_root: Path) -> None:
    model = llama_root / "llama"
    (model / "tokenizer_config.json").chmod(0o600)  # a private side file of the source
    env = {"FP8FORGE_ALLOWED_MODEL_ROOTS": str(llama_root), "FP8FORGE_POLL_INTERVAL_S": "0.2",
           "FP8FORGE_CONVERSION_THREADS": "1"}
    data = tmp_path / "data"
    previous = os.umask(0o022)  # the server inherits it
    try:
        with ServeProcess(data, workers=1, env=env) as server, server.client() as client:
            ids = {}
            for kind, fields in JOBS.items():
                response = client.post("/v1/jobs", json={"model": str(model), **fields})
                assert response.status_code == 202, response.text
                ids[kind] = response.json()["id"]
            for kind, job_id in ids.items():
                job = wait_for(lambda job_id=job_id: _finished(client, job_id), timeout=300, what=kind)
                assert job["status"] == "succeeded", (kind, job.get("error"), server.tail())
    finally:
        os.umask(previous)
    assert _mode(data) == 0o700 and _mode(data / "jobs") == 0o700
    database = [data / "fp8forge.db", *data.glob("fp8forge.db-*")]
    assert {path.name: _mode(path) for path in database} == {path.name: 0o600 for path in database}
    for kind, job_id in ids.items():
        artifact = data / "jobs" / job_id
        files = [path for path in artifact.rglob("*") if path.is_file()]
        assert len(files) > 3 and (artifact / "tokenizer_config.json") in files, (kind, files)
        loose = {path.relative_to(artifact).as_posix(): oct(_mode(path)) for path in files if _mode(path) & 0o137}
        assert loose == {}, (kind, loose)
        folders = [artifact, *(path for path in artifact.rglob("*") if path.is_dir())]
        assert {path.name: oct(_mode(path)) for path in folders if _mode(path) & 0o027} == {}, kind


def test_keys_create_makes_a_missing_data_dir_private(tmp_path: Path) -> None:
    """`fp8forge keys create` is often the first command of a deployment: the data dir it creates is 0700 too."""
    data = tmp_path / "data"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FP8FORGE_")}
    previous = os.umask(0o022)
    try:
        made = subprocess.run([*fp8forge_command(), "keys", "create", "carol"], capture_output=True, text=True,
                              timeout=120, env={**clean, "FP8FORGE_DATA_DIR": str(data)})
    finally:
        os.umask(previous)
    assert made.returncode == 0, made.stderr
    assert _mode(data) == 0o700 and _mode(data / "api_keys") == 0o600
