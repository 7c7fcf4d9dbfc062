"""End to end: `fp8forge serve` as a real subprocess converts a tiny local Llama; artifacts download (one
resumed with Range), match their sha256, load as safetensors, and survive an API restart."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from converters.pipeline.state import job_stages
from tests.service_helpers import ServeProcess, build_tiny_llama, leftovers, sse_events, wait_for

pytestmark = pytest.mark.slow


def _download(client, url: str, *, etag: str, size: int, resume_at: int | None) -> bytes:
    if resume_at is None:
        response = client.get(url)
        assert response.status_code == 200 and response.headers["etag"] == etag
        assert response.headers["content-length"] == str(size)
        return response.content
    first = client.get(url, headers={"Range": f"bytes=0-{resume_at - 1}"})  # the download that broke
    assert first.status_code == 206 and len(first.content) == resume_at
    rest = client.get(url, headers={"Range": f"bytes={resume_at}-", "If-Range": etag})
    assert rest.status_code == 206
    assert rest.headers["content-range"] == f"bytes {resume_at}-{size - 1}/{size}"
    return first.content + rest.content


def test_convert_follow_download_and_restart(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    models = tmp_path / "models"
    model_dir = build_tiny_llama(models / "tiny-llama")
    data = tmp_path / "data"
    env = {"FP8FORGE_ALLOWED_MODEL_ROOTS": str(models), "FP8FORGE_HEARTBEAT_INTERVAL_S": "0.5"}
    body = {"model": str(model_dir), "recipe": {"backend": "ao", "recipe_name": "tensorwise"},
            "calibration": {"steps": 4, "batch_size": 1, "seq_len": 32},
            "serving_formats": ["compressed-tensors-fp8"]}

    with ServeProcess(data, workers=1, env=env) as serve, serve.client() as client:
        wait_for(lambda: client.get("/readyz").status_code == 200, timeout=30, what="a worker heartbeat")
        created = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "e2e-1"})
        assert created.status_code == 202, created.text
        job_id = created.json()["id"]

        events = sse_events(client, f"/v1/jobs/{job_id}/events", timeout=120)
        stages = [data["stage"] for kind, data in events if kind == "stage"]
        assert stages == [stage.value for stage in job_stages(body)], serve.tail()  # plan only when asked
        assert events[-1] == ("status", events[-1][1]) and events[-1][1]["status"] == "succeeded", events[-1]
        assert any(kind == "progress" and data["stage"] == "calibrate" for kind, data in events)

        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded" and job["attempt"] == 1 and job["progress"]["fraction"] == 1.0
        listing = client.get(job["links"]["artifacts"]).json()["data"]
        names = {a["name"] for a in listing}
        served = "serving/compressed-tensors-fp8"
        assert {"model.safetensors", "manifest.json", "fp8_report.json",
                f"{served}/model.safetensors", f"{served}/config.json"} <= names
        largest = max(listing, key=lambda a: a["bytes"])["name"]
        for artifact in listing:
            etag = client.head(artifact["url"]).headers["etag"]
            content = _download(client, artifact["url"], etag=etag, size=artifact["bytes"],
                                resume_at=artifact["bytes"] // 2 if artifact["name"] == largest else None)
            assert hashlib.sha256(content).hexdigest() == artifact["sha256"] == etag.strip('"')
            (tmp_path / artifact["name"]).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / artifact["name"]).write_bytes(content)
        for name in names:
            if name.endswith(".safetensors"):
                assert load_file(tmp_path / name), f"{name} holds no tensors"
        assert "model.layers.0.mlp.down_proj.weight" in load_file(tmp_path / "model.safetensors")
        report = json.loads((tmp_path / "fp8_report.json").read_text())
        assert report["backend"] == "ao" and report["pipeline"]["mode"] == "layer_sequential"
        metrics = client.get("/metrics").text
        assert 'fp8forge_jobs{status="succeeded"} 1' in metrics
        assert 'fp8forge_stage_duration_seconds_count{stage="calibrate"} 1' in metrics
    assert leftovers(data / "jobs") == []

    # after a restart (API only) the job and its files are still served
    with ServeProcess(data, workers=0, env=env) as serve, serve.client() as client:
        again = client.get(f"/v1/jobs/{job_id}").json()
        assert again["status"] == "succeeded" and again["finished_at"] == job["finished_at"]
        assert client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"] == listing
        same = client.post("/v1/jobs", json=body, headers={"Idempotency-Key": "e2e-1"})
        assert same.json()["id"] == job_id
        manifest = client.get(f"/v1/jobs/{job_id}/artifacts/manifest.json")
        assert manifest.status_code == 200
