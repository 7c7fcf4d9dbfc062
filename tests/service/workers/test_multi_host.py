"""Two worker hosts without a shared disk: each `fp8forge worker` has a data directory of its own and shares only
PostgreSQL and the object store (moto's real HTTP server) with the other and with the API.

Both complete jobs of the demo model; one is killed with -9 in the middle of a job, the other finishes that
job; every job succeeds exactly once, none is lost, the bucket holds exactly the published attempts, and a
worker started again on the killed host clears the scratch its predecessor left.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.store import JobStore
from tests.object_store_server import AWS_ENV, bucket_keys, moto_server, new_bucket, s3_settings, unfinished_uploads
from tests.service_helpers import (
    fp8forge_command,
    leftovers,
    live_app,
    pid_alive,
    postgres_url,
    stop_process,
    wait_for,
    work_children,
)

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

BODY = {"model": "demo/tiny-llama", "recipe": {"backend": "ao", "recipe_name": "tensorwise"},
        "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}
TIMEOUT_S = 4.0  # heartbeat timeout: how soon the killed worker's job is requeued


@contextlib.contextmanager
def fresh_database() -> Iterator[str]:
    """A database of its own on the local PostgreSQL (the workers' `fp8forge worker` has no table prefix)."""
    admin_url = postgres_url()
    if admin_url is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432")
    name = f"fp8forge_mh_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


class WorkerHost:
    """`fp8forge worker` as a process of its own, with a data directory no other process shares."""

    def __init__(self, root: Path, env: dict[str, str]) -> None:
        self.data_dir = root / "data"
        self.log = root / "worker.log"
        root.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **env, "FP8FORGE_DATA_DIR": str(self.data_dir)}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerHost:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen([*fp8forge_command(), "worker"], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        stop_process(self.proc)

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


def test_two_hosts_share_only_the_database_and_the_bucket(tmp_path: Path) -> None:
    with fresh_database() as db_url, moto_server(tmp_path / "moto.log") as moto, \
            pytest.MonkeyPatch.context() as mp:
        for name, value in AWS_ENV.items():
            mp.setenv(name, value)
        bucket = new_bucket(moto)
        api = s3_settings(tmp_path / "api-host", moto.endpoint, bucket, database_url=db_url,
                          heartbeat_interval_s=0.5, heartbeat_timeout_s=TIMEOUT_S)
        JobStore(db_url).close()  # the schema, once, before three processes race to create it
        env = {**AWS_ENV, "FP8FORGE_DATABASE_URL": db_url, "FP8FORGE_ARTIFACT_STORE": "s3",
               "FP8FORGE_S3_BUCKET": bucket, "FP8FORGE_S3_ENDPOINT_URL": moto.endpoint,
               "FP8FORGE_S3_PREFIX": "fp8forge", "FP8FORGE_HF_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "FP8FORGE_HEARTBEAT_INTERVAL_S": "0.5", "FP8FORGE_HEARTBEAT_TIMEOUT_S": str(TIMEOUT_S),
               "FP8FORGE_POLL_INTERVAL_S": "0.2", "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
        hosts = [WorkerHost(tmp_path / f"gpu-host-{n}", env).start() for n in (1, 2)]
        store = JobStore(db_url)
        try:
            with live_app(api) as client:
                _run(client, store, hosts, moto, bucket)
        finally:
            for host in hosts:
                host.stop()
            store.close()


def _run(client, store: JobStore, hosts: list[WorkerHost], moto, bucket: str) -> None:
    logs = lambda: "\n".join(h.tail() for h in hosts)  # noqa: E731
    wait_for(lambda: len(store.workers.live(30)) == 2, timeout=60, what="two worker heartbeats")

    def finished(job_id: str) -> dict | None:
        job = client.get(f"/v1/jobs/{job_id}").json()
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    # Both hosts complete a job: two jobs submitted at once, one claimed by each idle worker.
    first = [client.post("/v1/jobs", json=BODY).json()["id"] for _ in range(2)]
    for job_id in first:
        ended = wait_for(lambda j=job_id: finished(j), timeout=120, what="a job to finish")
        assert ended["status"] == "succeeded", (ended, logs())
    by_pid = {int(store.get_job(j).worker_id.split(":")[1]) for j in first}
    assert by_pid == {h.pid for h in hosts}, "each host completed one job"

    # A third job: kill -9 whichever host runs it, in the middle of the run.
    job_id = client.post("/v1/jobs", json=BODY).json()["id"]
    wait_for(lambda: store.get_job(job_id).attempt == 1 and store.get_job(job_id).worker_id, timeout=30,
             what="a worker to claim the job")
    victim = next(h for h in hosts if h.pid == int(store.get_job(job_id).worker_id.split(":")[1]))
    survivor = next(h for h in hosts if h is not victim)
    scratch = victim.data_dir / "jobs"
    wait_for(lambda: leftovers(scratch), timeout=60, what="the job's scratch directory", interval=0.02)
    for child in work_children(victim.pid):  # frozen, so the run cannot finish before the kill on a slow machine
        os.kill(child, signal.SIGSTOP)
    assert store.get_job(job_id).status.value == "running"
    os.kill(victim.pid, signal.SIGKILL)
    victim.proc.wait()

    done = wait_for(lambda: finished(job_id), timeout=120, what="the other host to finish the job")
    assert done["status"] == "succeeded" and done["attempt"] == 2, (done, logs())
    assert int(store.get_job(job_id).worker_id.split(":")[1]) == survivor.pid

    jobs = [*first, job_id]
    for j in jobs:
        statuses = [e.data for e in store.events.after(j) if e.kind == "status"]
        assert [s["status"] for s in statuses].count("succeeded") == 1, statuses  # none ran twice to completion
    reasons = [e.data.get("reason") for e in store.events.after(job_id) if e.kind == "status"]
    assert reasons.count("worker_lost") == 1
    assert all(store.get_job(j).status.value == "succeeded" for j in jobs)  # none lost

    # the bucket holds exactly each job's published attempt; the killed attempt left no object or upload
    published = {f"fp8forge/jobs/{j}/a{store.get_job(j).attempt}/{a['name']}" for j in jobs
                 for a in store.get_job(j).artifacts}
    assert set(bucket_keys(moto, bucket)) == published
    assert unfinished_uploads(moto, bucket) == []
    model = next(a for a in client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]
                 if a["name"] == "model.safetensors")
    assert hashlib.sha256(client.get(model["url"]).content).hexdigest() == model["sha256"]
    assert leftovers(survivor.data_dir / "jobs") == []

    # the killed host's disk still holds its attempt; a worker started there again sweeps it at once
    assert leftovers(scratch)
    victim.start()
    wait_for(lambda: not leftovers(scratch), timeout=60, what=f"the restarted worker's sweep\n{victim.tail()}")
    assert pid_alive(victim.pid)
