"""`fp8forge serve` with FP8FORGE_EXECUTOR=slurm against the real test cluster (slurm_cluster.py): no local worker
runs; each job is a Slurm job (sbatch), its ranks started by srun, and the store keeps its state, events and
artifacts. A requantize job is a Slurm array whose tasks share its shards; a cancel through the API ends the Slurm
job (scancel of one still pending; the ranks of a running one stop it and end)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.jobs import TaskStatus
from service.store import JobStore
from tests.service.executors.slurm_cluster import SlurmCluster, pause_conversion_when, rank_pids
from tests.service_helpers import ServeProcess, build_tiny_llama, leftovers, wait_for

pytestmark = pytest.mark.slow

_FINISHED = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-layer Llama (calibrated jobs) and a four-layer one in several shards (requantize jobs)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("models")
    build_tiny_llama(root / "tiny-llama")
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "sharded", max_shard_size="2MB")
    return root


@contextlib.contextmanager
def serving(slurm: SlurmCluster, tmp_path: Path, models: Path, **settings: str) -> Iterator[httpx.Client]:
    env = {"FP8FORGE_EXECUTOR": "slurm", **slurm.env, "FP8FORGE_ALLOWED_MODEL_ROOTS": str(models),
           "FP8FORGE_HEARTBEAT_INTERVAL_S": "0.5", "FP8FORGE_HEARTBEAT_TIMEOUT_S": "10",
           "FP8FORGE_POLL_INTERVAL_S": "0.3", "FP8FORGE_CONVERSION_THREADS": "1", **settings}
    with ServeProcess(tmp_path / "data", workers=1, env=env) as server, server.client() as client:
        client.server = server  # type: ignore[attr-defined]  # its log, for the failure messages
        client.store_url = env.get(  # type: ignore[attr-defined]
            "FP8FORGE_DATABASE_URL", f"sqlite:///{tmp_path / 'data' / 'fp8forge.db'}")
        yield client


def _calibrated(models: Path, steps: int = 4) -> dict:
    return {"model": str(models / "tiny-llama"), "recipe": {"backend": "ao", "recipe_name": "tensorwise"},
            "calibration": {"steps": steps, "batch_size": 1, "seq_len": 32},
            "serving_formats": ["compressed-tensors-fp8"]}


def _submit(client: httpx.Client, body: dict) -> str:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _finished(client: httpx.Client, job_id: str) -> dict | None:
    job = client.get(f"/v1/jobs/{job_id}").json()
    return job if job["status"] in _FINISHED else None


def _events(client: httpx.Client, job_id: str) -> list[dict]:
    """The job's events as the store holds them (the API streams them; these tests look while the job runs)."""
    store = JobStore(client.store_url)  # type: ignore[attr-defined]
    try:
        return [{"kind": e.kind, "data": e.data} for e in store.events.after(job_id, limit=100_000)]
    finally:
        store.close()


def _slurm_ids(client: httpx.Client, job_id: str) -> list[str]:
    """The Slurm jobs the service submitted for the job, from its ``executor`` events."""
    return [e["data"]["slurm_job"] for e in _events(client, job_id) if e["kind"] == "executor"]


def _tail(client: httpx.Client) -> str:
    return client.server.tail()  # type: ignore[attr-defined]


def test_a_calibrated_job_runs_as_a_slurm_batch_job_and_publishes_through_the_store(
        slurm: SlurmCluster, tmp_path: Path, models: Path) -> None:
    import torch
    from safetensors.torch import load_file

    with serving(slurm, tmp_path, models) as client:
        assert wait_for(lambda: client.get("/readyz").status_code == 200, timeout=30, what="the dispatcher")
        job_id = _submit(client, _calibrated(models))
        done = wait_for(lambda: _finished(client, job_id), timeout=300, what="the job to finish")
        assert done["status"] == "succeeded" and done["attempt"] == 1, (done, _tail(client))
        [slurm_id] = _slurm_ids(client, job_id)
        wait_for(lambda: slurm.job_states(slurm_id) == ["COMPLETED"], timeout=60,
                 what=f"Slurm job {slurm_id} to complete: {slurm.job_states(slurm_id)}")  # its rank's exit
        assert slurm.job_field(slurm_id, "JobName") == f"fp8forge-{job_id}"
        kinds = [e["kind"] for e in _events(client, job_id)]
        assert kinds.index("executor") < kinds.index("stage") and "progress" in kinds
        listing = client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]
        served = "serving/compressed-tensors-fp8/model.safetensors"
        assert {"model.safetensors", "fp8_report.json", served} <= {entry["name"] for entry in listing}
        (tmp_path / "served.safetensors").write_bytes(
            client.get(next(e["url"] for e in listing if e["name"] == served)).content)
        assert torch.float8_e4m3fn in {t.dtype for t in load_file(tmp_path / "served.safetensors").values()}
        output = (tmp_path / "data" / "slurm" / job_id / f"slurm-{slurm_id}.out").read_text()
        assert f"rank 0 of 1 (local rank 0), rendezvous 127.0.0.1:{20_000 + int(slurm_id) % 10_000}" in output
        assert leftovers(tmp_path / "data" / "jobs") == []


def test_a_requantize_job_runs_as_a_slurm_array_whose_tasks_share_its_shards(
        slurm: SlurmCluster, tmp_path: Path, models: Path) -> None:
    from converters.modelfree import convert_model_free

    convert_model_free(models / "sharded", tmp_path / "local", "fp8-block")
    expected = {path.name: path.read_bytes() for path in (tmp_path / "local").iterdir()}
    with serving(slurm, tmp_path, models, FP8FORGE_SLURM_ARRAY_TASKS="3") as client:
        job_id = _submit(client, {"model": str(models / "sharded"), "requantize": {"to": "fp8-block"}})
        done = wait_for(lambda: _finished(client, job_id), timeout=300, what="the job to finish")
        assert done["status"] == "succeeded", (done, _tail(client))
        listing = client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]
        published = {entry["name"]: client.get(entry["url"]).content for entry in listing}
        assert sorted(published) == sorted(expected)
        assert [name for name in expected if published[name] != expected[name]] == []
        [slurm_id] = _slurm_ids(client, job_id)
        wait_for(lambda: set(slurm.job_states(slurm_id)) == {"COMPLETED"}, timeout=60,
                 what=f"every task of array {slurm_id} to complete: {slurm.job_states(slurm_id)}")
        assert len(slurm.job_states(slurm_id)) == 3
    store = JobStore(f"sqlite:///{tmp_path / 'data' / 'fp8forge.db'}")
    try:
        tasks = store.tasks.of_job(job_id)
    finally:
        store.close()
    assert {(t.status, t.attempt) for t in tasks} == {(TaskStatus.SUCCEEDED, 1)}
    runners = {t.worker_id.rsplit(":slurm-", 1)[1] for t in tasks}
    assert runners <= {f"{slurm_id}_{task}" for task in range(3)}, runners  # the array's tasks ran them all


def test_cancel_through_the_api_scancels_a_pending_slurm_job(slurm: SlurmCluster, tmp_path: Path,
                                                             models: Path) -> None:
    slurm.run("scontrol", "update", "PartitionName=debug", "State=DOWN")  # jobs are taken and none starts
    try:
        with serving(slurm, tmp_path, models) as client:
            job_id = _submit(client, _calibrated(models))
            [slurm_id] = wait_for(lambda: _slurm_ids(client, job_id), timeout=30, what="the submission")
            assert slurm.job_states(slurm_id) == ["PENDING"]
            assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "queued"
            assert client.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
            wait_for(lambda: slurm.job_states(slurm_id) == ["CANCELLED"], timeout=30,
                     what=f"scancel of Slurm job {slurm_id}")
            assert client.get(f"/v1/jobs/{job_id}").json()["status"] == "cancelled"
    finally:
        slurm.run("scontrol", "update", "PartitionName=debug", "State=UP")


def test_cancel_through_the_api_of_a_running_job_ends_its_slurm_job(slurm: SlurmCluster, tmp_path: Path,
                                                                    models: Path) -> None:
    with serving(slurm, tmp_path, models) as client:
        job_id = _submit(client, _calibrated(models, steps=400))
        wait_for(lambda: any(e["kind"] == "progress" and e["data"].get("stage") == "calibrate"
                             for e in _events(client, job_id)), timeout=180, what="calibration to start")
        [slurm_id] = _slurm_ids(client, job_id)
        assert slurm.job_states(slurm_id) == ["RUNNING"]
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
        done = wait_for(lambda: _finished(client, job_id), timeout=60, what="the cancel")
        assert done["status"] == "cancelled", (done, _tail(client))
        wait_for(lambda: slurm.job_states(slurm_id)[0] in ("COMPLETED", "CANCELLED"), timeout=60,
                 what=f"Slurm job {slurm_id} to end: {slurm.job_states(slurm_id)}")
        assert not [j for j in slurm.run("squeue", "--noheader", "--format=%i").split() if j == slurm_id]
        assert leftovers(tmp_path / "data" / "jobs") == []


def test_a_job_that_outlives_its_slurm_time_limit_goes_back_to_the_queue_and_is_submitted_again(
        slurm: SlurmCluster, tmp_path: Path, models: Path) -> None:
    """Slurm's own time limit ends the first allocation: its rank hands the attempt back without using it up, and
    the dispatcher submits the job again; the new allocation claims it."""
    # the four-layer, 256-wide model, 64 steps of 512 tokens a layer: each allocation's conversion is stopped, the
    # first right after layer 0 (its limit, five minutes, then lowered to end it), the second as soon as it starts,
    # so that the job is still running when it is cancelled; slurmd sends SIGCONT before SIGTERM when it ends the
    # job, the rank SIGKILL 3 s after SIGTERM on a cancel
    long_calibration = {**_calibrated(models), "model": str(models / "sharded"),
                        "calibration": {"steps": 64, "batch_size": 1, "seq_len": 512}}
    with serving(slurm, tmp_path, models, FP8FORGE_SLURM_TIME_LIMIT="5") as client:
        job_id = _submit(client, long_calibration)
        [first] = wait_for(lambda: _slurm_ids(client, job_id), timeout=30, what="the submission")
        assert slurm.job_field(first, "TimeLimit") == "00:05:00"  # the setting, on sbatch's command line
        record = tmp_path / "data" / "slurm" / job_id / "resume"
        pause_conversion_when(first, lambda: (record / "layer-0.safetensors").exists(), timeout=300,
                              context=lambda: _tail(client))
        slurm.end_by_time_limit(first)
        wait_for(lambda: slurm.job_states(first)[0] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"),
                 timeout=300, what=f"Slurm's time limit to end job {first}", interval=1)
        assert slurm.job_states(first) == ["TIMEOUT"], _tail(client)
        second = wait_for(lambda: _slurm_ids(client, job_id)[1:], timeout=60, what="the job submitted again")
        pause_conversion_when(second[0], lambda: True, timeout=120, context=lambda: _tail(client))
        claims = lambda: [e["data"] for e in _events(client, job_id)  # noqa: E731
                          if e["kind"] == "status" and e["data"]["status"] == "running"]
        wait_for(lambda: len(claims()) == 2, timeout=120, what="the second allocation to claim the job")
        handed_back = [e["data"] for e in _events(client, job_id)
                       if e["kind"] == "status" and e["data"]["status"] == "queued" and "reason" in e["data"]]
        assert [event["reason"] for event in handed_back] == ["worker_shutdown"], handed_back
        assert [claim["attempt"] for claim in claims()] == [1, 1]  # the time limit used up no attempt
        # the job's resume record (docs/distributed.md) outlives the first allocation, for the second to continue
        assert record.is_dir() and any(record.iterdir()), sorted(p.name for p in record.parent.iterdir())
        assert client.post(f"/v1/jobs/{job_id}/cancel").status_code in (200, 202)
        assert wait_for(lambda: _finished(client, job_id), timeout=60, what="the cancel")["status"] == "cancelled"
        wait_for(lambda: slurm.job_states(second[0])[0] in ("COMPLETED", "CANCELLED"), timeout=60,
                 what=f"Slurm job {second[0]} to end")
        wait_for(lambda: not record.exists(), timeout=30, what="the cancelled job's resume record to go")


@pytest.mark.postgres
def test_both_kinds_of_job_on_postgresql_and_the_object_store(slurm: SlurmCluster, tmp_path: Path,
                                                              models: Path) -> None:
    """The deployment docs/deployment.md describes: the ranks and array tasks reach the store and the bucket
    themselves (no shared data dir), and the API serves what they published."""
    from converters.modelfree import convert_model_free
    from tests.object_store_server import AWS_ENV, bucket_keys, moto_server, new_bucket
    from tests.service.workers.test_multi_host import fresh_database

    convert_model_free(models / "sharded", tmp_path / "local", "fp8-block")
    expected = {path.name: path.read_bytes() for path in (tmp_path / "local").iterdir()}
    with fresh_database() as db_url, moto_server(tmp_path / "moto.log") as moto:
        bucket = new_bucket(moto)
        settings = {**AWS_ENV, "FP8FORGE_DATABASE_URL": db_url, "FP8FORGE_ARTIFACT_STORE": "s3",
                    "FP8FORGE_S3_BUCKET": bucket, "FP8FORGE_S3_ENDPOINT_URL": moto.endpoint,
                    "FP8FORGE_S3_PREFIX": "fp8forge", "FP8FORGE_SLURM_ARRAY_TASKS": "2"}
        with serving(slurm, tmp_path, models, **settings) as client:
            calibrated = _submit(client, _calibrated(models))
            requantize = _submit(client, {"model": str(models / "sharded"), "requantize": {"to": "fp8-block"}})
            for job_id in (calibrated, requantize):
                done = wait_for(lambda job_id=job_id: _finished(client, job_id), timeout=400, what="the jobs")
                assert done["status"] == "succeeded", (done, _tail(client))
                assert len(_slurm_ids(client, job_id)) == 1
            listing = client.get(f"/v1/jobs/{requantize}/artifacts").json()["data"]
            published = {entry["name"]: client.get(entry["url"]).content for entry in listing}
            assert published == expected
            served = [e["name"] for e in client.get(f"/v1/jobs/{calibrated}/artifacts").json()["data"]]
            keys = bucket_keys(moto, bucket)
            assert {f"fp8forge/jobs/{calibrated}/a1/{name}" for name in served} <= set(keys), keys[:10]
            assert {f"fp8forge/jobs/{requantize}/a1/{name}" for name in expected} <= set(keys), keys[:10]


def test_a_calibrated_job_on_two_nodes_runs_a_rank_on_each_and_rank_0_alone_records_it(
        slurm: SlurmCluster, tmp_path: Path, models: Path) -> None:
    """Two nodes, one rank each: rank 0 claims and publishes; rank 1 runs the same conversion entry point beside
    it with the same rendezvous (until the child runs the data-parallel calibration, a whole conversion into its
    scratch, which it removes) and ends with the job."""
    with serving(slurm, tmp_path, models, FP8FORGE_SLURM_NODES="2") as client:
        job_id = _submit(client, _calibrated(models))
        done = wait_for(lambda: _finished(client, job_id), timeout=300, what="the job to finish")
        assert done["status"] == "succeeded" and done["attempt"] == 1, (done, _tail(client))
        [slurm_id] = _slurm_ids(client, job_id)
        wait_for(lambda: slurm.job_states(slurm_id) == ["COMPLETED"], timeout=120,
                 what=f"Slurm job {slurm_id} to complete: {slurm.job_states(slurm_id)}")
        assert slurm.job_field(slurm_id, "NodeList") == "node[1-2]"
        output = (tmp_path / "data" / "slurm" / job_id / f"slurm-{slurm_id}.out").read_text()
        rendezvous = f"rendezvous 127.0.0.1:{20_000 + int(slurm_id) % 10_000}"
        for rank in (0, 1):
            assert f"rank {rank} of 2 (local rank 0), {rendezvous}" in output, output
        claims = [e for e in _events(client, job_id) if e["kind"] == "status" and e["data"]["status"] == "running"]
        assert len(claims) == 1  # rank 1 never claims
        assert [p.name for p in (tmp_path / "data" / "slurm" / job_id).iterdir() if p.name.startswith("rank-")] == []


def test_kill_9_of_a_rank_ends_its_allocation_and_the_job_runs_again_in_a_new_one(
        slurm: SlurmCluster, tmp_path: Path, models: Path) -> None:
    with serving(slurm, tmp_path, models) as client:
        job_id = _submit(client, _calibrated(models, steps=200))
        wait_for(lambda: any(e["kind"] == "stage" for e in _events(client, job_id)), timeout=180,
                 what="the rank to start the conversion")
        [first] = _slurm_ids(client, job_id)
        [rank] = rank_pids(job_id)
        os.kill(rank, signal.SIGKILL)
        wait_for(lambda: slurm.job_states(first)[0] not in ("RUNNING", "COMPLETING"), timeout=60,
                 what=f"srun to end Slurm job {first}")
        assert slurm.job_states(first) == ["FAILED"]
        done = wait_for(lambda: _finished(client, job_id), timeout=300, what="the job to finish")
        assert done["status"] == "succeeded" and done["attempt"] == 2, (done, _tail(client))
        later = _slurm_ids(client, job_id)[1:]
        assert later, _tail(client)
        reasons = [e["data"].get("reason") for e in _events(client, job_id)
                   if e["kind"] == "status" and e["data"]["status"] == "queued"]
        assert reasons == [None, "worker_lost"]  # submitted, then handed back by the reaper once
        # one later allocation ran the job; on a loaded machine the dispatcher may have submitted a spare one that
        # found nothing to claim: every one of them ends
        wait_for(lambda: any(slurm.job_states(j) == ["COMPLETED"] for j in later), timeout=60,
                 what=f"one of Slurm jobs {later} to complete")
        wait_for(lambda: all(slurm.job_states(j)[0] not in ("PENDING", "RUNNING", "COMPLETING") for j in later),
                 timeout=120, what=f"Slurm jobs {later} to end")
        assert leftovers(tmp_path / "data" / "jobs") == []


def test_a_node_that_cannot_start_the_rank_fails_the_job_after_three_slurm_jobs_naming_their_output(
        slurm: SlurmCluster, tmp_path: Path, models: Path) -> None:
    with serving(slurm, tmp_path, models, FP8FORGE_SLURM_PYTHON="/opt/no-such-fp8forge/bin/python") as client:
        job_id = _submit(client, _calibrated(models))
        done = wait_for(lambda: _finished(client, job_id), timeout=120, what="the job to fail")
        assert done["status"] == "failed" and done["error"]["code"] == "executor_failed", done
        slurm_ids = _slurm_ids(client, job_id)
        assert len(slurm_ids) == 3 and all(slurm.job_states(i) == ["FAILED"] for i in slurm_ids)
        message = done["error"]["message"]
        assert "3 Slurm jobs in a row" in message and "FP8FORGE_SLURM_PYTHON" in message, message
        assert str(tmp_path) not in message  # the server's directories stay out of what clients read
        output = tmp_path / "data" / "slurm" / job_id / f"slurm-{slurm_ids[-1]}.out"
        assert f"slurm-{slurm_ids[-1]}.out in FP8FORGE_SLURM_WORK_DIR/{job_id}/" in message, message
        assert "/opt/no-such-fp8forge/bin/python" in output.read_text()
