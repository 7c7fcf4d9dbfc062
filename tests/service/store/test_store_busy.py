"""A request that waits on a lock a stalled process holds answers 503 store_busy with Retry-After (it may well
succeed a moment later), never 500, and the server stays up for everything else."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from service.config import Settings
from tests.service_helpers import live_app


def test_a_write_behind_a_held_lock_is_503_store_busy(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", auth_disabled=True, workers=0, store_lock_timeout_s=0.5)
    with live_app(settings) as client:
        job = client.post("/v1/jobs", json={"model": "demo/tiny-llama"}).json()
        holder = sqlite3.connect(settings.data_dir / "fp8forge.db", isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")  # the write lock, as a process stopped inside its write holds it
            for method, path in [("POST", f"/v1/jobs/{job['id']}/cancel"), ("POST", "/v1/jobs")]:
                answer = client.request(method, path, json={"model": "demo/tiny-llama"} if path == "/v1/jobs" else None)
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "store_busy"
                assert answer.headers["retry-after"] == "5"
            assert client.get("/healthz").status_code == 200
        finally:
            holder.rollback()
            holder.close()
        assert client.post(f"/v1/jobs/{job['id']}/cancel").json()["status"] == "cancelled"
