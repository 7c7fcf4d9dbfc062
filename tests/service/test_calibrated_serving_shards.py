"""A calibrated job whose serving export runs as shard tasks, through the HTTP API on real worker processes
(`fp8forge serve --workers 2`, PostgreSQL): once calibration has set the scales, each weight file of each serving
format is a ``serving_write`` task any worker claims; the conversion writes the rest and publishes. The serving
files are byte for byte those of the same request converted in one process; events count shards done / total.
kill -9 of the worker holding one such task: that shard alone runs again and the job succeeds once.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from service.jobs import TaskStatus
from service.store import JobStore
from service.store.tasks import SERVING_WRITE
from tests.service.test_requantize_jobs import _finished, _published, kill_9_while_holding, serving
from tests.service.workers.test_multi_host import fresh_database
from tests.service_helpers import leftovers, sse_events, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

#: nvfp4 with GPTQ rounding (the recipe's nvfp4_weight_rounding): its shard tasks copy what calibration rounded; with
#: nvfp4_smoothing every task reads the smoothed model (the artifact's copy), not the source the worker resolves
FORMATS = ["compressed-tensors-fp8", "fp8-block", "nvfp4"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A four-layer Llama in several weight files, its Linears divisible by fp8-block's 128 x 128 blocks."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = tmp_path_factory.mktemp("models") / "tiny-llama-sharded"
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory, max_shard_size="2MB")
    assert len(list(directory.glob("*.safetensors"))) >= 4
    return directory


def _submit(client: httpx.Client, model_dir: Path) -> str:
    body = {"model": str(model_dir), "recipe": {"backend": "ao", "recipe_name": "tensorwise",
                                                "nvfp4_weight_rounding": "gptq", "nvfp4_smoothing": "awq"},
            "calibration": {"steps": 1, "batch_size": 1, "seq_len": 16}, "serving_formats": FORMATS}
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _served(files: dict[str, bytes]) -> dict[str, bytes]:
    return {name: content for name, content in files.items() if name.startswith("serving/")}


def _one_process(request: dict, model_dir: Path, out: Path) -> dict[str, bytes]:
    """The job's stored request converted here, in one process with the worker's one CPU thread."""
    import torch

    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import ConversionRequest

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_conversion(ConversionRequest.from_dict(request), out, ModelSourceOptions(allowed_roots=(model_dir.parent,)))
    finally:
        torch.set_num_threads(threads)
    return {str(path.relative_to(out)): path.read_bytes() for path in out.rglob("*") if path.is_file()}


def _tasks(db_url: str, job_id: str):
    store = JobStore(db_url)
    try:
        return store.tasks.of_job(job_id), store.get_job(job_id)
    finally:
        store.close()


def test_the_serving_export_runs_as_shard_tasks_with_the_bytes_of_one_process(tmp_path: Path,
                                                                               model_dir: Path) -> None:
    weight_files = len(list(model_dir.glob("*.safetensors")))
    with fresh_database() as db_url, serving(tmp_path, model_dir, workers=2, database=db_url) as server, \
            server.client() as client:
        job_id = _submit(client, model_dir)
        events = sse_events(client, f"/v1/jobs/{job_id}/events", timeout=600)
        done = client.get(f"/v1/jobs/{job_id}").json()
        assert done["status"] == "succeeded", (done, server.tail())
        published = _published(client, job_id)
        tasks, job = _tasks(db_url, job_id)
        assert leftovers(server.data_dir / "jobs") == []

    assert [t.kind for t in tasks] == [SERVING_WRITE] * (weight_files * len(FORMATS))
    assert {(t.status, t.attempt) for t in tasks} == {(TaskStatus.SUCCEEDED, 1)}
    shards = [(data["shards_done"], data["shards_total"]) for kind, data in events
              if kind == "progress" and "shards_total" in data]
    assert shards[0] == (0, len(tasks)) and shards[-1] == (len(tasks), len(tasks))
    assert [done for done, _ in shards] == sorted(done for done, _ in shards)
    expected = _served(_one_process(job.request, model_dir, tmp_path / "one-process"))
    served = _served(published)
    assert sorted(served) == sorted(expected)
    assert [name for name in expected if served[name] != expected[name]] == []


def test_kill_9_of_a_worker_holding_a_serving_shard_redoes_that_shard_alone(tmp_path: Path, model_dir: Path) -> None:
    with fresh_database() as db_url, serving(tmp_path, model_dir, workers=2, database=db_url) as server, \
            server.client() as client:
        store = JobStore(db_url)
        try:
            job_id = _submit(client, model_dir)

            def held_by_the_other_worker():
                job = store.get_job(job_id)
                return next((t for t in store.tasks.of_job(job_id, kind=SERVING_WRITE)
                             if t.status is TaskStatus.RUNNING and t.worker_id != job.worker_id), None)

            task = wait_for(held_by_the_other_worker, timeout=600, what="a serving shard on the other worker",
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
            warnings = [e.data for e in store.events.after(job_id) if e.kind == "warning"
                        and e.data.get("reason") == "worker_lost"]
            assert [w["shard"] for w in warnings] == [task.shard]
        finally:
            store.close()
        published = _published(client, job_id)
        jobs_dir = server.data_dir / "jobs"
        time.sleep(1)
        assert leftovers(jobs_dir) == []
        assert sorted(p.name for p in jobs_dir.iterdir()) == [job_id]
        # the artifact holds exactly the published files: the killed writer's attempt left nothing beside them
        on_disk = sorted(str(p.relative_to(jobs_dir / job_id)) for p in (jobs_dir / job_id).rglob("*") if p.is_file())
        assert on_disk == sorted(published)


def test_cancel_during_the_serving_shards_stops_them_and_leaves_nothing(tmp_path: Path, model_dir: Path) -> None:
    with fresh_database() as db_url, serving(tmp_path, model_dir, workers=2, database=db_url) as server, \
            server.client() as client:
        store = JobStore(db_url)
        try:
            job_id = _submit(client, model_dir)
            wait_for(lambda: [t for t in store.tasks.of_job(job_id, kind=SERVING_WRITE)
                              if t.status is TaskStatus.RUNNING], timeout=600, what="a running serving shard",
                     interval=0.05)
            assert client.post(f"/v1/jobs/{job_id}/cancel").status_code == 202
            done = wait_for(lambda: _finished(client, job_id), timeout=120, what="the cancel to settle")
            assert done["status"] == "cancelled", (done, server.tail())
            wait_for(lambda: not [t for t in store.tasks.of_job(job_id)
                                  if t.status in (TaskStatus.QUEUED, TaskStatus.RUNNING)],
                     timeout=60, what="every shard task to stop")
            assert any(t.status is TaskStatus.CANCELLED for t in store.tasks.of_job(job_id))
        finally:
            store.close()
        assert client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"] == []
        jobs_dir = server.data_dir / "jobs"
        assert wait_for(lambda: not leftovers(jobs_dir) and not (jobs_dir / job_id).exists(), timeout=60,
                        what="the cancelled job's files to go")
