"""A plan task's result too large for its ``job_tasks.result`` row (a requantize job's report: tens of megabytes for
a checkpoint of 100,000 tensors) is stored as a file in the job attempt's scratch area, the row holding a
reference; the job's later tasks read back the same report. With an object store the result stays in the row.
Real SQLite store, real artifact directories, the worker's own task run code."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from service.artifacts.local import ArtifactDirs
from service.config import Settings
from service.workers.task_results import MAX_RESULT_ROW_BYTES, TaskResultMissing, loaded_result, stored_result
from service.workers.task_run import TaskRun
from tests.service_helpers import make_store


def _report(layers: int) -> dict:
    """A requantize report's shape: an entry per tensor, a few hundred bytes each."""
    rows = [{"key": f"model.layers.{i}.mlp.experts.{i % 256}.down_proj.weight", "module": f"model.layers.{i}.mlp",
             "shard": f"model-{i // 600:05d}-of-00163.safetensors", "kind": "linear", "eligible": i % 7 != 0,
             "reasons": [] if i % 7 else ["shape_not_divisible"]} for i in range(layers)]
    return {"version": 1, "format": "fp8-block", "layers": rows,
            "quantized": {row["key"]: row["key"] for row in rows if row["eligible"]}}


def test_a_plan_result_over_the_row_limit_is_a_file_the_finish_task_reads_back(tmp_path: Path) -> None:
    report = _report(20_000)
    assert len(json.dumps({"report": report})) > MAX_RESULT_ROW_BYTES
    settings = Settings(data_dir=tmp_path / "data", workers=0, auth_disabled=True)
    dirs = ArtifactDirs(settings.jobs_dir)
    with make_store("sqlite", tmp_path) as (store, _, _):
        job, _ = store.create_job({"model": "org/m", "requantize": {"to": "fp8-block"}}, request_hash="h")
        job = store.claim_next("w1")
        assert store.tasks.split(job.id, "w1", job.attempt, source="org/m", payload={}, max_attempts=2)
        plan = store.tasks.claim("w1", "host-a")
        finish = {"kind": "finish", "shard": None, "phase": 3, "payload": {}}
        run = TaskRun(settings, store, dirs, "w1", plan, threading.Event())
        assert run._succeed(job, {"tasks": [finish], "report": report}) is not None

        with store.engine.connect() as conn:
            row = conn.execute(sa.text("SELECT result FROM job_tasks WHERE kind = 'plan'")).scalar_one()
        assert len(row) < 1000, row[:200]  # a reference, not the report
        reference = json.loads(row)["result_file"]
        path = dirs.staging_dir(job.id, job.attempt) / reference["name"]
        assert path.stat().st_size == reference["bytes"] > MAX_RESULT_ROW_BYTES
        assert not path.is_relative_to(dirs.attempt_dir(job.id, job.attempt))  # never published

        task = store.tasks.claim("w2", "host-b")
        assert task is not None and task.kind == "finish"
        inputs = TaskRun(settings, store, dirs, "w2", task, threading.Event())._inputs()
        assert inputs["report"] == report and inputs["writes"] == []

        path.write_bytes(path.read_bytes().replace(b"fp8-block", b"fp8-bloch"))  # not the bytes recorded
        with pytest.raises(TaskResultMissing, match="not the one written"):
            loaded_result(dirs, job.id, store.tasks.results(job.id, "plan")[0])
        dirs.remove_attempt(job.id, job.attempt)  # the scratch area goes with its attempt
        assert not path.exists()


def test_a_small_result_and_any_result_with_an_object_store_stay_in_the_row(tmp_path: Path) -> None:
    dirs = ArtifactDirs(tmp_path / "jobs")
    small = {"report": _report(10)}
    assert stored_result(dirs, "a" * 32, 1, 7, small) is small
    large = {"report": _report(20_000)}

    class Remote(ArtifactDirs):
        remote = True

    assert stored_result(Remote(tmp_path / "jobs"), "a" * 32, 1, 7, large) is large
    assert not (tmp_path / "jobs").exists()
