"""A job whose recipe's shape rule leaves no layer eligible, submitted to a real server and worker (`fp8forge serve
--workers 1`, SQLite), fails as bad input naming the recipes whose rule the model's dims meet, never its own
(issue #35, item 5)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.service_helpers import ServeProcess, build_tiny_llama, leftovers, wait_for

pytestmark = pytest.mark.slow


def test_a_job_that_would_convert_nothing_names_recipes_that_would(tmp_path: Path) -> None:
    models = tmp_path / "models"
    build_tiny_llama(models / "llama")  # widths 64, 128 and 32 (k/v): % 32 everywhere, never % 128
    env = {"FP8FORGE_ALLOWED_MODEL_ROOTS": str(models), "FP8FORGE_POLL_INTERVAL_S": "0.2",
           "FP8FORGE_CONVERSION_THREADS": "1"}
    with ServeProcess(tmp_path / "data", workers=1, env=env) as server, server.client() as client:
        body = {"model": str(models / "llama"), "recipe": {"backend": "te", "scaling": "nvfp4_block"},
                "calibration": {"steps": 1, "seq_len": 8}}
        submitted = client.post("/v1/jobs", json=body)
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]

        def finished() -> dict | None:
            job = client.get(f"/v1/jobs/{job_id}").json()
            return job if job["status"] in ("succeeded", "failed", "cancelled") else None

        job = wait_for(finished, timeout=300, what=f"job {job_id}\n{server.tail()}")
        assert job["status"] == "failed", (job, server.tail())
        error = job["error"]
        assert error["code"] == "invalid_request", error
        message = error["message"]
        assert "both Linear dims divisible by 128, which no layer meets" in message, message
        suggested = message.split("dims meet: ", 1)[1]
        assert "te-delayed" in suggested and "te-mxfp8" in suggested and "ao-rowwise" in suggested, message
        assert "te-nvfp4" not in suggested and "te-float8-block" not in suggested, message
        assert leftovers(server.data_dir / "jobs") == []
