"""Workers under `fp8forge serve`: cancel stops a running job within 5 s; a worker killed with -9 mid-job
takes its conversion child with it, the job is requeued and then succeeds; nothing partial is left.

To catch a job mid-run on a machine of any speed, the test freezes the conversion process (SIGSTOP) as
soon as its staging directory appears; no sleeps live in product code.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from service.artifacts import ArtifactDirs
from service.store import JobStore
from tests.service_helpers import (
    ServeProcess,
    build_tiny_llama,
    leftovers,
    pid_alive,
    sse_events,
    wait_for,
    work_children,
)

pytestmark = pytest.mark.slow

BODY = {"recipe": {"backend": "ao", "recipe_name": "tensorwise"},
        "calibration": {"steps": 200, "batch_size": 2, "seq_len": 128}}


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("lifecycle")
    build_tiny_llama(root / "models" / "tiny-llama")
    # A cancel must end within the 5 s the API promises: a short grace leaves room for a loaded machine.
    # The heartbeat timeout is generous, so a busy machine never makes a live job look lost.
    env = {"FP8FORGE_ALLOWED_MODEL_ROOTS": str(root / "models"), "FP8FORGE_HEARTBEAT_INTERVAL_S": "0.5",
           "FP8FORGE_HEARTBEAT_TIMEOUT_S": "10", "FP8FORGE_POLL_INTERVAL_S": "0.3", "FP8FORGE_CANCEL_GRACE_S": "0.5"}
    with ServeProcess(root / "data", workers=1, env=env) as serve, serve.client() as client:
        wait_for(lambda: client.get("/readyz").status_code == 200, timeout=30, what="a worker heartbeat")
        serve.model = str(root / "models" / "tiny-llama")
        yield serve, client


def _freeze_mid_run(serve, client, job_id: str) -> tuple[int, int]:
    """Wait until the job's pipeline is staging files, then SIGSTOP it; returns (worker pid, child pid)."""
    staging = ArtifactDirs(serve.data_dir / "jobs").staging_dir(job_id, 1)
    wait_for(staging.exists, timeout=60, what="the job's staging directory", interval=0.01)
    worker_pid = int(_stored_worker_id(serve, job_id).split(":")[1])  # clients see an opaque name only
    (child,) = work_children(worker_pid)
    os.kill(child, signal.SIGSTOP)
    job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "running" and staging.exists(), job
    return worker_pid, child


def _stored_worker_id(serve, job_id: str) -> str:
    store = JobStore(f"sqlite:///{serve.data_dir / 'fp8forge.db'}")
    try:
        return store.get_job(job_id).worker_id
    finally:
        store.close()


def test_cancel_of_a_running_job_finishes_within_5s_and_leaves_nothing(serve) -> None:
    serve, client = serve
    job_id = client.post("/v1/jobs", json={"model": serve.model, **BODY}).json()["id"]
    _, child = _freeze_mid_run(serve, client, job_id)

    started = time.monotonic()
    answer = client.post(f"/v1/jobs/{job_id}/cancel")
    os.kill(child, signal.SIGCONT)
    assert answer.status_code == 202 and answer.json()["status"] == "cancelling"
    wait_for(lambda: client.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled", timeout=5,
             what="status cancelled", interval=0.05)
    assert time.monotonic() - started < 5

    events = sse_events(client, f"/v1/jobs/{job_id}/events", timeout=10)
    assert [d["status"] for k, d in events if k == "status"] == ["queued", "running", "cancelling", "cancelled"]
    assert client.get(f"/v1/jobs/{job_id}/artifacts").json() == {"data": [], "count": 0}
    wait_for(lambda: not pid_alive(child), timeout=5, what="the conversion process to end")
    jobs_dir = serve.data_dir / "jobs"
    assert not (jobs_dir / job_id).exists() and leftovers(jobs_dir) == []
    assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 409


def test_killed_worker_job_is_requeued_and_succeeds_without_partial_files(serve) -> None:
    serve, client = serve
    job_id = client.post("/v1/jobs", json={"model": serve.model, **BODY}).json()["id"]
    worker_pid, child = _freeze_mid_run(serve, client, job_id)
    first_worker = client.get(f"/v1/jobs/{job_id}").json()["worker_id"]

    os.kill(worker_pid, signal.SIGKILL)
    # frozen, the child's own watcher cannot act: the kernel ends it when its fork server exits, after the server's
    # interpreter teardown (about 2 s of torch's on 2 cores)
    wait_for(lambda: not pid_alive(child), timeout=15, what="the conversion process to die with its worker")

    def finished():
        job = client.get(f"/v1/jobs/{job_id}").json()
        return job if job["status"] in ("succeeded", "failed", "cancelled") else None

    done = wait_for(finished, timeout=120, what="the retried job to finish", interval=0.2)
    assert done["status"] == "succeeded", (done, serve.tail())
    assert done["attempt"] == 2 and done["worker_id"] != first_worker
    events = sse_events(client, f"/v1/jobs/{job_id}/events", timeout=10)
    statuses = [(d["status"], d.get("reason")) for k, d in events if k == "status"]
    assert statuses == [("queued", None), ("running", None), ("queued", "worker_lost"), ("running", None),
                        ("succeeded", None)]

    jobs_dir = serve.data_dir / "jobs"
    assert leftovers(jobs_dir) == []
    listing = client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]
    on_disk = sorted(p.relative_to(jobs_dir / job_id).as_posix() for p in (jobs_dir / job_id).rglob("*")
                     if p.is_file())
    assert on_disk == sorted(a["name"] for a in listing)
    assert client.get("/readyz").status_code == 200  # the pool restarted the worker
