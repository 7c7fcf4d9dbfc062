"""A full disk on one of two worker hosts (issue 34, finding 3): what fails there for want of room runs again on
the other host, once, instead of going back to the full one until the job fails.

Two real `fp8forge worker` processes share only PostgreSQL and the object store (moto's real HTTP server); one's
data directory is a tmpfs filled to the last byte (mounting it needs root: skipped without). The host with room is
paused (SIGSTOP) while the job is submitted, so the full host claims the work first, and resumed once the full
host has failed it: from then on both could take the retry, and it must go to the host with room, although the
full host read the source (its cache affinity) and polls as often.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.store import JobStore
from service.store.host_faults import public_host_name, this_host
from tests.models import save_tiny_model
from tests.object_store_server import AWS_ENV, moto_server, new_bucket, s3_settings
from tests.service.test_disk_full import fill, small_filesystem
from tests.service.test_requantize_jobs import (  # noqa: F401 - the module's sharded model fixture
    _finished,
    model_dir,
)
from tests.service.workers.test_multi_host import WorkerHost, fresh_database
from tests.service_helpers import live_app, wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

CALIBRATED = {"recipe": {"backend": "ao", "recipe_name": "tensorwise"},
              "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}


@dataclass
class Hosts:
    client: httpx.Client
    store: JobStore
    full: WorkerHost
    roomy: WorkerHost

    def name(self, host: WorkerHost) -> str:
        """The host's name in the job's events."""
        return public_host_name(this_host(host.data_dir))

    def logs(self) -> str:
        return f"full host:\n{self.full.tail()}\nhost with room:\n{self.roomy.tail()}"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Hosts]:  # noqa: F811
    root = tmp_path_factory.mktemp("host-faults")
    with fresh_database() as db_url, moto_server(root / "moto.log") as moto, pytest.MonkeyPatch.context() as mp, \
            small_filesystem(root / "full-host" / "data", "1m") as small:
        for name, value in AWS_ENV.items():
            mp.setenv(name, value)
        bucket = new_bucket(moto)
        api = s3_settings(root / "api-host", moto.endpoint, bucket, database_url=db_url,
                          allowed_model_roots=(model_dir.parent,))
        JobStore(db_url).close()  # the schema, once, before three processes race to create it
        # a generous heartbeat timeout: the paused host stays live (so the full one must leave it the retry) for
        # as long as the full host may take to start its task server and fail
        env = {**AWS_ENV, "FP8FORGE_DATABASE_URL": db_url, "FP8FORGE_ARTIFACT_STORE": "s3",
               "FP8FORGE_S3_BUCKET": bucket, "FP8FORGE_S3_ENDPOINT_URL": moto.endpoint,
               "FP8FORGE_S3_PREFIX": "fp8forge", "FP8FORGE_HF_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
               "FP8FORGE_ALLOWED_MODEL_ROOTS": str(model_dir.parent), "FP8FORGE_CONVERSION_THREADS": "1",
               "FP8FORGE_HEARTBEAT_INTERVAL_S": "0.5", "FP8FORGE_HEARTBEAT_TIMEOUT_S": "120",
               "FP8FORGE_POLL_INTERVAL_S": "0.2", "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
        full, roomy = WorkerHost(root / "full-host", env).start(), WorkerHost(root / "roomy-host", env).start()
        store = JobStore(db_url)
        try:
            with live_app(api) as client:
                wait_for(lambda: len(store.workers.live(30)) == 2, timeout=120, what="both worker hosts live")
                fill(small)  # after the worker made its directories: from now on nothing more fits
                yield Hosts(client, store, full, roomy)
        finally:
            for host in (full, roomy):
                host.stop()
            store.close()


def _run_with_the_full_host_first(hosts: Hosts, body: dict[str, Any], failed_there: Any) -> dict[str, Any]:
    """Submit ``body`` while the host with room is paused; resume it once ``failed_there(events)`` holds."""
    os.kill(hosts.roomy.pid, signal.SIGSTOP)
    try:
        response = hosts.client.post("/v1/jobs", json=body)
        assert response.status_code == 202, response.text
        job_id = response.json()["id"]
        wait_for(lambda: failed_there([e.data for e in hosts.store.events.after(job_id)]), timeout=240,
                 what=f"the full host to run out of room\n{hosts.logs()}")
    finally:
        os.kill(hosts.roomy.pid, signal.SIGCONT)
    done = wait_for(lambda: _finished(hosts.client, job_id), timeout=300, what="the job to finish")
    assert done["status"] == "succeeded", (done, hosts.logs())
    return done


def test_shards_that_fill_one_hosts_disk_are_written_on_the_other(hosts: Hosts, model_dir: Path) -> None:  # noqa: F811
    disk_full = lambda events: [e for e in events if e.get("reason") == "disk_full"]  # noqa: E731
    done = _run_with_the_full_host_first(hosts, {"model": str(model_dir), "requantize": {"to": "fp8-block"}},
                                         disk_full)
    stored = hosts.store.events.after(done["id"])
    failed = disk_full([e.data for e in stored])
    # each task the full host failed failed there once: its retry went to the host with room, not back
    names = [(e["shard"], e.get("message", "")) for e in failed]
    assert len({shard for shard, _ in names}) == len(names), names
    assert {e["host"] for e in failed} == {hosts.name(hosts.full)}
    assert all("another host" in message for _, message in names), names
    retries = [e.data for e in stored if e.kind == "retry"]
    assert sorted(e["shard"] or "" for e in retries) == sorted(shard or "" for shard, _ in names)
    assert {e["host"] for e in retries} == {hosts.name(hosts.roomy)}
    # a host fault uses up none of the task's attempts
    tasks = {t.seq: t for t in hosts.store.tasks.of_job(done["id"])}
    retried = [t for t in tasks.values() if t.attempt > 1]
    assert retried and all((t.attempt, t.max_attempts) == (2, 4) for t in retried), [
        (t.name, t.attempt, t.max_attempts) for t in tasks.values()]
    assert all(t.host == this_host(hosts.roomy.data_dir) for t in retried)
    listing = hosts.client.get(f"/v1/jobs/{done['id']}/artifacts").json()["data"]
    assert any(entry["name"].endswith(".safetensors") for entry in listing)


def test_a_calibrated_job_that_filled_one_hosts_disk_runs_again_on_the_other(hosts: Hosts, model_dir: Path) -> None:  # noqa: F811
    model = model_dir.parent / "tiny-llama"
    if not model.exists():
        save_tiny_model("llama", model)
    requeued = lambda events: [e for e in events if e.get("status") == "queued" and e.get("reason")]  # noqa: E731
    done = _run_with_the_full_host_first(hosts, {**CALIBRATED, "model": str(model)}, requeued)
    events = [e.data for e in hosts.store.events.after(done["id"])]
    (fault,) = requeued(events)
    assert fault["reason"] == "disk_full" and fault["host"] == hosts.name(hosts.full), fault
    assert "another host" in fault["message"] and "attempt 1 of 3" in fault["message"]
    running = [e["host"] for e in events if e.get("status") == "running"]
    assert running == [hosts.name(hosts.full), hosts.name(hosts.roomy)]  # claimed once there, then here
    assert (done["attempt"], done["max_attempts"]) == (2, 4)  # the fault used up no attempt
