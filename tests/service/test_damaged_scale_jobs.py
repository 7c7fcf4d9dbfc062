"""FP8 sources with damaged scales submitted as jobs to a real server and worker (`fp8forge serve --workers 1`,
SQLite): requantize and calibrated jobs fail as ``invalid_model_config`` (bad input, never ``internal_error``), the
error names the tensor, and nothing is published. The damages are those of
tests/converters/modelfree/test_damaged_scales.py."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.converters.modelfree.test_damaged_scales import DAMAGES, build_damaged_sources
from tests.service_helpers import ServeProcess, leftovers, wait_for

pytestmark = pytest.mark.slow

#: (damage, the job's fields)
CASES = [
    ("nan_scale", {"requantize": {"to": "fp8-block"}}),
    ("inf_scale", {"requantize": {"to": "bf16"}}),
    ("huge_scale", {"requantize": {"to": "fp8-block"}}),
    ("nan_code", {"requantize": {"to": "bf16"}}),
    ("rank3_scale", {"requantize": {"to": "fp8-block"}}),
    ("rank3_scale", {"requantize": {"to": "bf16"}}),
    ("rank3_scale", {"recipe": {"backend": "te"}, "calibration": {"steps": 1, "seq_len": 8}}),
    ("nan_scale", {"recipe": {"backend": "te"}, "calibration": {"steps": 1, "seq_len": 8}}),
]


def _finished(client: httpx.Client, job_id: str) -> dict | None:
    job = client.get(f"/v1/jobs/{job_id}").json()
    return job if job["status"] in ("succeeded", "failed", "cancelled") else None


def test_damaged_scales_fail_their_jobs_as_bad_input(tmp_path: Path) -> None:
    root = build_damaged_sources(tmp_path / "models")
    env = {"FP8FORGE_ALLOWED_MODEL_ROOTS": str(root), "FP8FORGE_POLL_INTERVAL_S": "0.2",
           "FP8FORGE_CONVERSION_THREADS": "1"}
    with ServeProcess(tmp_path / "data", workers=1, env=env) as server, server.client() as client:
        jobs = []
        for damage, fields in CASES:
            response = client.post("/v1/jobs", json={"model": str(root / damage), **fields})
            assert response.status_code == 202, response.text
            jobs.append((damage, fields, response.json()["id"]))
        for damage, fields, job_id in jobs:
            job = wait_for(lambda job_id=job_id: _finished(client, job_id), timeout=300, what=f"{damage} {fields}")
            assert job["status"] == "failed", (damage, fields, job, server.tail())
            error = job["error"]
            _, named, words = DAMAGES[damage]
            assert error["code"] == "invalid_model_config", (damage, fields, error)
            assert named in error["message"] and words in error["message"], (damage, fields, error)
            listing = client.get(f"/v1/jobs/{job_id}/artifacts")
            assert listing.status_code != 200 or listing.json()["data"] == [], (damage, fields, listing.text)
        assert leftovers(server.data_dir / "jobs") == []
