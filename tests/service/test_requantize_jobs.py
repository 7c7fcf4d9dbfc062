"""A requantize job through the HTTP API, spread over real worker processes (`fp8forge serve --workers N`).

On SQLite with one worker and on PostgreSQL with two: the published files are byte for byte those of
`convert_model_free` run here; events count shards done / total. A cancel stops every task and leaves nothing.
kill -9 of the worker holding a shard task: that shard alone runs again, the job succeeds once, and the artifact
store holds exactly the published files.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service.jobs import TaskStatus
from service.store import JobStore
from tests.service.workers.test_multi_host import fresh_database
from tests.service_helpers import (
    ServeProcess,
    children_of,
    freeze_worker,
    kill_9_frozen_worker,
    leftovers,
    live_app,
    queue_only_settings,
    sse_events,
    wait_for,
    work_children,
)

pytestmark = pytest.mark.slow

SHARDS = 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A four-layer Llama in several shards, its Linears divisible by fp8-block's 128 x 128 blocks."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = tmp_path_factory.mktemp("models") / "tiny-llama-sharded"
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size="2MB")
    assert len(list(directory.glob("*.safetensors"))) >= SHARDS
    return directory


@contextlib.contextmanager
def serving(tmp_path: Path, model_dir: Path, *, workers: int, database: str | None,
            settings: dict[str, str] | None = None) -> Iterator[ServeProcess]:
    env = {"FP8FORGE_ALLOWED_MODEL_ROOTS": str(model_dir.parent), "FP8FORGE_HEARTBEAT_INTERVAL_S": "0.5",
           "FP8FORGE_HEARTBEAT_TIMEOUT_S": "5", "FP8FORGE_POLL_INTERVAL_S": "0.2", "FP8FORGE_CONVERSION_THREADS": "1",
           **(settings or {})}
    if database is not None:
        env["FP8FORGE_DATABASE_URL"] = database
    with ServeProcess(tmp_path / "data", workers=workers, env=env) as server:
        yield server


def _submit(client: httpx.Client, model_dir: Path, target: str) -> str:
    response = client.post("/v1/jobs", json={"model": str(model_dir), "requantize": {"to": target}})
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _finished(client: httpx.Client, job_id: str) -> dict | None:
    try:
        job = client.get(f"/v1/jobs/{job_id}").json()
    except httpx.RemoteProtocolError:
        # the server closed this idle keep-alive connection (uvicorn's 5 s idle timeout, reached while the test
        # watched the store) as the request went out: the next poll opens a new one. A dead server still fails
        # the test: its next poll raises ConnectError.
        return None
    return job if job["status"] in ("succeeded", "failed", "cancelled") else None


def _local_conversion(model_dir: Path, out: Path, target: str) -> dict[str, bytes]:
    from converters.modelfree import convert_model_free

    convert_model_free(model_dir, out, target)
    return {path.name: path.read_bytes() for path in out.iterdir()}


def _published(client: httpx.Client, job_id: str) -> dict[str, bytes]:
    listing = client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]
    return {entry["name"]: client.get(entry["url"]).content for entry in listing}


def _check_same_bytes(client: httpx.Client, job_id: str, expected: dict[str, bytes]) -> None:
    published = _published(client, job_id)
    assert sorted(published) == sorted(expected)
    assert [name for name in expected if published[name] != expected[name]] == []


def test_sqlite_and_one_worker_run_the_job_start_to_finish(tmp_path: Path, model_dir: Path) -> None:
    expected = _local_conversion(model_dir, tmp_path / "local", "fp8-block")
    with serving(tmp_path, model_dir, workers=1, database=None) as server, server.client() as client:
        job_id = _submit(client, model_dir, "fp8-block")
        events = sse_events(client, f"/v1/jobs/{job_id}/events", timeout=300)
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded", (job, server.tail())
        _check_same_bytes(client, job_id, expected)
        shards = [(data["shards_done"], data["shards_total"]) for kind, data in events if kind == "progress"]
        total = len(list(model_dir.glob("*.safetensors")))
        assert shards[0] == (0, total) and shards[-1] == (total, total)
        assert [data["stage"] for kind, data in events if kind == "stage"] == ["analyze", "convert", "export"]
        store = JobStore(f"sqlite:///{server.data_dir / 'fp8forge.db'}")
        try:
            tasks = store.tasks.of_job(job_id)
        finally:
            store.close()
        assert [t.kind for t in tasks] == ["plan", *["write"] * total, "finish"]
        assert {(t.status, t.attempt) for t in tasks} == {(TaskStatus.SUCCEEDED, 1)}
        assert leftovers(server.data_dir / "jobs") == []


@pytest.mark.postgres
def test_two_workers_on_postgresql_split_the_shards(tmp_path: Path, model_dir: Path) -> None:
    expected = _local_conversion(model_dir, tmp_path / "local", "nvfp4-a16")  # with the amax map and reduce
    with fresh_database() as db_url, serving(tmp_path, model_dir, workers=2, database=db_url) as server, \
            server.client() as client:
        job_id = _submit(client, model_dir, "nvfp4-a16")
        done = wait_for(lambda: _finished(client, job_id), timeout=300, what="the job to finish")
        assert done["status"] == "succeeded", (done, server.tail())
        _check_same_bytes(client, job_id, expected)
        store = JobStore(db_url)
        try:
            tasks = store.tasks.of_job(job_id)
        finally:
            store.close()
        assert [t.kind for t in tasks].count("amax") >= 1
        assert {(t.status, t.attempt) for t in tasks} == {(TaskStatus.SUCCEEDED, 1)}
        assert len({t.worker_id for t in tasks}) == 2, "both workers ran tasks"
        assert leftovers(server.data_dir / "jobs") == []


def test_a_truncated_shard_fails_the_job_naming_it_and_nothing_is_published(tmp_path: Path, model_dir: Path) -> None:
    import shutil

    broken = tmp_path / "models" / "truncated"
    shutil.copytree(model_dir, broken)
    victim = sorted(broken.glob("*.safetensors"))[1]
    with victim.open("r+b") as f:  # the header stays whole: the tensors' bytes end early
        f.truncate(victim.stat().st_size - 4096)
    with serving(tmp_path, broken, workers=1, database=None) as server, server.client() as client:
        job_id = _submit(client, broken, "fp8-block")
        done = wait_for(lambda: _finished(client, job_id), timeout=300, what="the job to finish")
        assert done["status"] == "failed", (done, server.tail())
        assert victim.name in done["error"]["message"], done["error"]
        assert client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"] == []
        jobs_dir = server.data_dir / "jobs"
        assert wait_for(lambda: not leftovers(jobs_dir) and not (jobs_dir / job_id).exists(), timeout=30,
                        what="the failed job's files to go")


def _running_write_task(store: JobStore, job_id: str):
    return next((t for t in store.tasks.of_job(job_id, kind="write") if t.status is TaskStatus.RUNNING), None)


@pytest.mark.postgres
def test_kill_9_of_a_worker_holding_a_shard_task_redoes_that_shard_alone(tmp_path: Path, model_dir: Path) -> None:
    expected = _local_conversion(model_dir, tmp_path / "local", "fp8-block")
    with fresh_database() as db_url, serving(tmp_path, model_dir, workers=2, database=db_url) as server, \
            server.client() as client:
        store = JobStore(db_url)
        try:
            job_id = _submit(client, model_dir, "fp8-block")
            task = wait_for(lambda: _running_write_task(store, job_id), timeout=120, what="a running write task",
                            interval=0.02)
            kill_9_while_holding(store, job_id, task)

            done = wait_for(lambda: _finished(client, job_id), timeout=300, what="the job to finish")
            assert done["status"] == "succeeded", (done, server.tail())
            tasks = store.tasks.of_job(job_id)
            attempts = {t.seq: t.attempt for t in tasks}
            assert attempts.pop(task.seq) == 2
            assert set(attempts.values()) == {1}, "the other shards ran once"
            assert all(t.status is TaskStatus.SUCCEEDED for t in tasks)
            statuses = [e.data["status"] for e in store.events.after(job_id) if e.kind == "status"]
            assert statuses == ["queued", "running", "succeeded"]
            warnings = [e.data for e in store.events.after(job_id) if e.kind == "warning"]
            assert [w["shard"] for w in warnings] == [task.shard]
            assert warnings[0]["reason"] == "worker_lost"
        finally:
            store.close()
        _check_same_bytes(client, job_id, expected)
        # the artifact store holds exactly the published files: the killed attempt left nothing
        jobs_dir = server.data_dir / "jobs"
        time.sleep(1)
        assert leftovers(jobs_dir) == []
        assert sorted(p.name for p in jobs_dir.iterdir()) == [job_id]
        assert sorted(p.name for p in (jobs_dir / job_id).iterdir()) == sorted(expected)


@pytest.mark.postgres
def test_cancel_stops_every_task_and_leaves_nothing(tmp_path: Path, model_dir: Path) -> None:
    with fresh_database() as db_url, serving(tmp_path, model_dir, workers=2, database=db_url) as server, \
            server.client() as client:
        store = JobStore(db_url)
        try:
            job_id = _submit(client, model_dir, "fp8-block")
            wait_for(lambda: _running_write_task(store, job_id), timeout=120, what="a running write task",
                     interval=0.05)
            assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
            done = wait_for(lambda: _finished(client, job_id), timeout=60, what="the cancel to settle")
            assert done["status"] == "cancelled", (done, server.tail())
            tasks = store.tasks.of_job(job_id)
            assert not [t for t in tasks if t.status in (TaskStatus.QUEUED, TaskStatus.RUNNING)]
            assert any(t.status is TaskStatus.CANCELLED for t in tasks)
            assert [t for t in tasks if t.kind == "finish"][0].status is TaskStatus.CANCELLED
            assert wait_for(lambda: not children_of_workers(server), timeout=30, what="every task child to stop")
        finally:
            store.close()
        assert client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"] == []
        jobs_dir = server.data_dir / "jobs"
        assert wait_for(lambda: not leftovers(jobs_dir) and not (jobs_dir / job_id).exists(), timeout=30,
                        what="the cancelled job's files to go")


def children_of_workers(server: ServeProcess) -> list[int]:
    """The task (or conversion) children of the server's workers: none once every task has stopped."""
    assert server.proc is not None
    return [child for worker in children_of(server.proc.pid) for child in work_children(worker)]


def kill_9_while_holding(store, job_id: str, task) -> None:
    """kill -9 the worker running ``task``: frozen first (with its task children), checked to still hold the task
    (a frozen worker records nothing, so the kill lands while it holds it, however fast the machine)."""
    victim = int(task.worker_id.split(":")[1])
    children = freeze_worker(victim)
    held = next(t for t in store.tasks.of_job(job_id) if t.seq == task.seq)
    assert held.status is TaskStatus.RUNNING and held.worker_id == task.worker_id
    kill_9_frozen_worker(victim, children)


@pytest.mark.parametrize(("body", "field"), [
    ({"requantize": {"to": "fp8-block"}, "recipe": {"backend": "ao"}}, "recipe"),
    ({"requantize": {"to": "fp8-block"}, "serving_formats": ["fp8-block"]}, "serving_formats"),
    ({"requantize": {"to": "fp8-block"}, "calibration": {"steps": 2}}, "calibration"),
    ({"requantize": {"to": "nvfp4"}}, "requantize.to"),
    ({"requantize": {"to": "fp8-block", "workers": 4}}, "requantize.workers"),
])
def test_combinations_that_make_no_sense_are_refused(tmp_path: Path, body: dict, field: str) -> None:
    with live_app(queue_only_settings(tmp_path)) as client:
        response = client.post("/v1/jobs", json={"model": "demo/tiny-llama", **body})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field, error
    assert error["message"]


def test_the_api_offers_the_targets_model_free_conversion_has() -> None:
    from converters.errors import RequestError
    from converters.modelfree.targets import model_free_target
    from converters.pipeline.request import REQUANTIZE_TARGETS, SERVING_FORMAT_NAMES

    for name in REQUANTIZE_TARGETS:
        assert model_free_target(name) is not None
    for name in set(SERVING_FORMAT_NAMES) - set(REQUANTIZE_TARGETS):
        with pytest.raises(RequestError):
            model_free_target(name)
