"""Artifact listing and downloads over real HTTP: sha256, ETag, Content-Length, Range resume, HEAD, 404s."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from service.config import Settings
from service.store import JobStore
from tests.service_helpers import live_app, publish_job

PAYLOAD = os.urandom(200_000)
FILES = {"model.safetensors": PAYLOAD, "fp8_report.json": b'{"converted": 14}', "manifest.json": b"[]"}


@pytest.fixture
def served(tmp_path: Path):
    settings = Settings(data_dir=tmp_path / "data", workers=0)
    with live_app(settings) as client:
        store = JobStore(settings.store_url)
        job = publish_job(store, settings.jobs_dir, FILES)
        yield client, job, settings
        store.close()


def test_listing_names_sizes_hashes_and_urls(served) -> None:
    client, job, _ = served
    listing = client.get(f"/v1/jobs/{job.id}/artifacts").json()
    assert listing["count"] == 3
    by_name = {a["name"]: a for a in listing["data"]}
    assert by_name["model.safetensors"] == {
        "name": "model.safetensors", "bytes": len(PAYLOAD), "sha256": hashlib.sha256(PAYLOAD).hexdigest(),
        "url": f"/v1/jobs/{job.id}/artifacts/model.safetensors"}
    got = client.get(f"/v1/jobs/{job.id}").json()
    assert got["links"]["report"] == f"/v1/jobs/{job.id}/artifacts/fp8_report.json"
    assert got["progress"]["fraction"] == 1.0


def test_download_is_whole_with_etag_and_length(served) -> None:
    client, job, _ = served
    response = client.get(f"/v1/jobs/{job.id}/artifacts/model.safetensors")
    assert response.status_code == 200 and response.content == PAYLOAD
    assert response.headers["content-length"] == str(len(PAYLOAD))
    assert response.headers["etag"] == f'"{hashlib.sha256(PAYLOAD).hexdigest()}"'
    assert response.headers["accept-ranges"] == "bytes"


def test_broken_download_resumes_with_range(served) -> None:
    client, job, _ = served
    url = f"/v1/jobs/{job.id}/artifacts/model.safetensors"
    etag = client.head(url).headers["etag"]
    half = len(PAYLOAD) // 2
    with client.stream("GET", url) as response:  # the connection "breaks" after half the file
        received = b""
        for chunk in response.iter_bytes():
            received += chunk
            if len(received) >= half:
                break
    received = received[:half]
    rest = client.get(url, headers={"Range": f"bytes={half}-", "If-Range": etag})
    assert rest.status_code == 206
    assert rest.headers["content-range"] == f"bytes {half}-{len(PAYLOAD) - 1}/{len(PAYLOAD)}"
    assert received + rest.content == PAYLOAD


def test_if_range_with_an_old_etag_sends_the_whole_file(served) -> None:
    client, job, _ = served
    response = client.get(f"/v1/jobs/{job.id}/artifacts/model.safetensors",
                          headers={"Range": "bytes=10-", "If-Range": '"stale"'})
    assert response.status_code == 200 and response.content == PAYLOAD


def test_head_gives_headers_without_body(served) -> None:
    client, job, _ = served
    response = client.head(f"/v1/jobs/{job.id}/artifacts/model.safetensors")
    assert response.status_code == 200 and response.content == b""
    assert response.headers["content-length"] == str(len(PAYLOAD))


def test_unsatisfiable_range_is_416(served) -> None:
    client, job, _ = served
    response = client.get(f"/v1/jobs/{job.id}/artifacts/model.safetensors",
                          headers={"Range": f"bytes={len(PAYLOAD) + 10}-"})
    assert response.status_code == 416


@pytest.mark.parametrize("name", ["missing.safetensors", "../../fp8forge.db", "..%2F..%2Ffp8forge.db",
                                  "%2Fetc%2Fpasswd"])
def test_unknown_or_escaping_names_are_404(served, name: str) -> None:
    client, job, _ = served
    response = client.get(f"/v1/jobs/{job.id}/artifacts/{name}")
    assert response.status_code == 404
    # (a client may normalise "../" away, which then names another job)
    assert response.json()["error"]["code"] in {"artifact_not_found", "job_not_found", "not_found"}


def test_delete_removes_the_files(served) -> None:
    client, job, settings = served
    assert (settings.jobs_dir / job.id / "model.safetensors").exists()
    assert client.delete(f"/v1/jobs/{job.id}").status_code == 204
    assert not (settings.jobs_dir / job.id).exists()
    assert client.get(f"/v1/jobs/{job.id}/artifacts/model.safetensors").status_code == 404
