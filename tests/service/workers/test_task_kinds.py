"""One form for every task a worker claims, and one registry of kinds: a task's form round-trips through JSON, a
form of another version is refused, and a stored row of a kind this release does not run fails its job, naming the
kind, instead of running as something else. Real SQLite store, the worker's own task run code."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import sqlalchemy as sa

from converters.errors import ConversionError
from service.artifacts.local import ArtifactDirs
from service.config import Settings
from service.jobs import JobStatus, TaskStatus
from service.workers.task_kinds import TASK_KINDS, ShardTask, plan_payload
from service.workers.task_run import TaskRun
from tests.service_helpers import make_store


def test_a_task_goes_through_json_and_back_as_itself() -> None:
    task = ShardTask("write", "model-00001-of-00002.safetensors", {"convert": ["a.weight"], "planned_bytes": 8})
    wire = json.loads(json.dumps(task.to_dict()))
    assert wire["version"] == 1 and wire["phase"] == TASK_KINDS["write"].phase == 2
    assert ShardTask.from_dict(wire) == task
    # the converters' task lists leave the version and the phase out: the registry gives both
    assert ShardTask.from_dict({"kind": "serving_write", "shard": "m.safetensors", "payload": {}}).phase == 0


def test_a_requantize_plan_queues_its_tasks_in_the_registry_form_at_their_kinds_phases(tmp_path: Path) -> None:
    from converters.model.demo import build_tiny_llama
    from converters.model.files import FileConfinement
    from converters.modelfree.stored import run_stored_task

    source = build_tiny_llama(tmp_path / "llama")
    request = {"model": str(source), "requantize": {"to": "nvfp4-a16", "measure": False}, "exclude": ["lm_head"]}
    result = run_stored_task("plan", plan_payload(request), {}, source, tmp_path / "out",
                             FileConfinement(roots=(tmp_path,)))
    queued = [ShardTask.from_dict(json.loads(json.dumps(task))) for task in result["tasks"]]
    assert [task.kind for task in queued] == ["amax", "write", "finish"]  # the tiny model: one shard
    assert [task.phase for task in queued] == [TASK_KINDS[task.kind].phase for task in queued] == [1, 2, 3]
    assert queued[1].payload["measure"] is False and result["report"]["options"]["exclude"] == ["lm_head"]
    assert not {"source_dir", "out_dir"} & set(queued[1].payload)  # each machine resolves its own paths


@pytest.mark.parametrize(("wire", "says"), [
    ({"version": 2, "kind": "write", "shard": "s", "payload": {}}, "form version 2"),
    ({"kind": "write", "shard": "s", "payload": {}, "attempt": 1}, "unknown keys"),
    ({"kind": "serving_copy", "shard": "s", "payload": {}}, "task kind 'serving_copy' is not one"),
])
def test_a_form_this_release_does_not_read_is_refused_naming_why(wire: dict, says: str) -> None:
    with pytest.raises(ConversionError, match=says):
        ShardTask.from_dict(wire)


def test_a_stored_task_of_an_unknown_kind_fails_its_job_naming_the_kind(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", workers=0, auth_disabled=True)
    dirs = ArtifactDirs(settings.jobs_dir)
    with make_store("sqlite", tmp_path) as (store, _, _):
        store.create_job({"model": "org/m", "requantize": {"to": "fp8-block"}}, request_hash="h")
        job = store.claim_next("w1")
        assert store.tasks.split(job.id, "w1", job.attempt, source="org/m", payload={}, max_attempts=2)
        with store.engine.begin() as conn:  # as a later release might have queued it
            conn.execute(sa.text("UPDATE job_tasks SET kind = 'reshard'"))
        task = store.tasks.claim("w1", "host-a")

        assert TaskRun(settings, store, dirs, "w1", task, threading.Event()).execute() is TaskStatus.FAILED
        failed = store.get_job(job.id)
        assert failed.status is JobStatus.FAILED
        assert "task kind 'reshard' is not one this release of fp8forge runs" in failed.error_message
        assert [t.status for t in store.tasks.of_job(job.id)] == [TaskStatus.FAILED]
