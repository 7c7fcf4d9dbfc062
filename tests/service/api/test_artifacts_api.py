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
    settings = Settings(data_dir=tmp_path / "data", workers=0, auth_disabled=True)
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


@pytest.mark.parametrize("header,start,end", [
    ("bytes=0-99", 0, 99), ("bytes=100-", 100, len(PAYLOAD) - 1), ("bytes=-100", len(PAYLOAD) - 100, len(PAYLOAD) - 1),
    ("bytes=10-999999999", 10, len(PAYLOAD) - 1), (f"bytes=-{len(PAYLOAD) * 2}", 0, len(PAYLOAD) - 1),
])
def test_one_range_is_206_with_exactly_those_bytes(served, header: str, start: int, end: int) -> None:
    client, job, _ = served
    response = client.get(f"/v1/jobs/{job.id}/artifacts/model.safetensors", headers={"Range": header})
    assert response.status_code == 206, response.text
    assert response.content == PAYLOAD[start:end + 1]
    assert response.headers["content-range"] == f"bytes {start}-{end}/{len(PAYLOAD)}"
    assert response.headers["content-length"] == str(end - start + 1)


@pytest.mark.parametrize("header", [f"bytes={len(PAYLOAD) + 10}-", f"bytes={len(PAYLOAD)}-", "bytes=-0", "bytes=5-2",
                                    "bytes=0-1,5-6", "bytes=abc", "bytes=²-".encode(), "items=0-5",
                                    "bytes=" + "9" * 30 + "-"])
def test_a_range_that_cannot_be_served_is_416_in_the_error_shape(served, header: str | bytes) -> None:
    client, job, _ = served
    response = client.get(f"/v1/jobs/{job.id}/artifacts/model.safetensors", headers={"Range": header})
    assert response.status_code == 416
    assert response.headers["content-range"] == f"bytes */{len(PAYLOAD)}"
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert error["code"] == "range_not_satisfiable" and error["field"] == "Range" and "bytes=" in error["message"]


# Percent-encoded, so that the client sends them as they are (httpx would resolve a literal "../" itself and the
# request would never reach the artifact route).
@pytest.mark.parametrize("name", ["missing.safetensors", "..%2F..%2Ffp8forge.db", "..%2Fmodel.safetensors",
                                  "%2E%2E%2F%2E%2E%2Ffp8forge.db", "%2Fetc%2Fpasswd", "sub%2F..%2Fmodel.safetensors"])
def test_unknown_or_escaping_names_are_404(served, name: str) -> None:
    client, job, settings = served
    assert (settings.data_dir / "fp8forge.db").exists()  # what an escape would reach
    response = client.get(f"/v1/jobs/{job.id}/artifacts/{name}")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "artifact_not_found"


def test_delete_removes_the_files(served) -> None:
    client, job, settings = served
    assert (settings.jobs_dir / job.id / "model.safetensors").exists()
    assert client.delete(f"/v1/jobs/{job.id}").status_code == 204
    assert not (settings.jobs_dir / job.id).exists()
    assert client.get(f"/v1/jobs/{job.id}/artifacts/model.safetensors").status_code == 404
