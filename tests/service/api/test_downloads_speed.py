"""The download streaming path the throughput work touched, over real HTTP: files of several chunks, ranges
across chunk boundaries, empty files, and a client that leaves mid-download (no timing is asserted here;
benchmarks/bench_api.py measures the speed)."""

from __future__ import annotations

import hashlib
import os
import socket
from pathlib import Path

import pytest

from service.api.streaming import PIECE_BYTES
from service.config import Settings
from service.store import JobStore
from tests.service_helpers import live_app, publish_job, wait_for

BIG = os.urandom(3 * PIECE_BYTES + 12_345)  # three whole chunks and a partial one
HUGE = bytes(range(256)) * (32 << 12)  # 32 MiB: far more than loopback socket buffers hold


@pytest.fixture
def served(tmp_path: Path):
    settings = Settings(data_dir=tmp_path / "data", workers=0, auth_disabled=True)
    with live_app(settings) as client:
        store = JobStore(settings.store_url)
        job = publish_job(store, settings.jobs_dir, {"model.safetensors": BIG, "empty.txt": b"", "huge.bin": HUGE})
        yield client, job, settings
        store.close()


def test_a_file_of_several_chunks_arrives_whole(served) -> None:
    client, job, _ = served
    response = client.get(f"/v1/jobs/{job.id}/artifacts/model.safetensors")
    assert response.status_code == 200 and response.headers["content-length"] == str(len(BIG))
    assert hashlib.sha256(response.content).hexdigest() == hashlib.sha256(BIG).hexdigest()


@pytest.mark.parametrize(("first", "last"), [
    (PIECE_BYTES - 1, PIECE_BYTES),              # two bytes either side of a chunk boundary
    (1, 2 * PIECE_BYTES + 7),               # starts inside the first chunk, ends inside the third
    (3 * PIECE_BYTES, len(BIG) - 1),        # the partial last chunk alone
])
def test_a_range_across_chunk_boundaries_is_exact(served, first: int, last: int) -> None:
    client, job, _ = served
    response = client.get(f"/v1/jobs/{job.id}/artifacts/model.safetensors", headers={"Range": f"bytes={first}-{last}"})
    assert response.status_code == 206
    assert response.headers["content-range"] == f"bytes {first}-{last}/{len(BIG)}"
    assert response.content == BIG[first:last + 1]


def test_an_empty_file_downloads_and_the_connection_stays_usable(served) -> None:
    client, job, _ = served
    for _ in range(2):  # the same keep-alive connection: a response left unfinished would break the next one
        response = client.get(f"/v1/jobs/{job.id}/artifacts/empty.txt")
        assert response.status_code == 200 and response.content == b""
        assert response.headers["content-length"] == "0"
    assert client.get(f"/v1/jobs/{job.id}/artifacts/model.safetensors").content == BIG


def test_a_client_that_leaves_mid_download_releases_the_file(served) -> None:
    client, job, settings = served
    path = settings.jobs_dir / job.id / "huge.bin"
    port = int(str(client.base_url).rsplit(":", 1)[1].rstrip("/"))
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.connect(("127.0.0.1", port))
        sock.sendall(f"GET /v1/jobs/{job.id}/artifacts/huge.bin HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 200")
        wait_for(lambda: _open_in_this_process(path), timeout=10, what="the server to hold the file open")
    wait_for(lambda: not _open_in_this_process(path), timeout=30, what="the server to close the file")
    again = client.get(f"/v1/jobs/{job.id}/artifacts/huge.bin", headers={"Range": "bytes=0-9"})
    assert again.status_code == 206 and again.content == HUGE[:10]


def _open_in_this_process(path: Path) -> bool:
    """Whether this process (the server runs in a thread of it) holds ``path`` open."""
    fds = Path("/proc/self/fd")
    if not fds.exists():
        pytest.skip("needs /proc")
    target = str(path.resolve())
    for fd in fds.iterdir():
        try:
            if os.readlink(fd) == target:
                return True
        except OSError:
            continue
    return False
