"""Every kind of task a worker claims from ``job_tasks``, in one registry, and the one form a task travels in.

Whichever job queued a task (a requantize job's plan and its shard tasks, a calibrated job's serving export shards),
it is a :class:`ShardTask` (kind, shard, payload); :data:`TASK_KINDS` says, per kind, which stage it counts towards,
what it reads of earlier tasks, where it writes, what its success does and which converter runs it, so a worker
runs any task through :func:`run_task` without knowing its job. Torch-free: the store and the API read the registry;
the runners import the converters (and torch) only where a task runs.

A stored row is this form: its ``kind``, ``shard`` and ``phase`` columns and its ``payload`` JSON, as rows have been
since ``job_tasks`` exists, so rows queued by an earlier release run as they are. A row whose kind this release does
not know fails its job, saying so (:func:`task_kind`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converters.errors import ConversionError
from converters.model.files import FileConfinement
from service.jobs import Stage, Task

__all__ = ["SERVING_WRITE", "TASK_FORM_VERSION", "TASK_KINDS", "Outcome", "OutputDir", "ShardTask", "TaskKind",
           "plan_payload", "run_task", "task_kind", "task_kinds_description"]

#: The version of :meth:`ShardTask.to_dict`; a form without one is version 1 (the converters' task lists).
TASK_FORM_VERSION = 1


class OutputDir(str, enum.Enum):
    """Where a task writes on its worker."""

    #: The job attempt's directory, which the job's finish publishes.
    ATTEMPT = "attempt"
    #: The staging sibling of the attempt's directory, where the conversion that queued the task reads it.
    STAGING = "staging"


class Outcome(str, enum.Enum):
    """What the worker does with a task's result besides recording it."""

    RECORD = "record"
    #: The result names the job's next tasks, which are queued with it; its report may go to a file (task_results).
    ADDS_TASKS = "adds_tasks"
    #: The result's ``file`` is uploaded to the object store (when the artifacts are there) and its local copy goes.
    UPLOADS_FILE = "uploads_file"
    #: The job's files are published and the job succeeds in the transaction that records the result.
    PUBLISHES = "publishes"


#: ``runner(task, inputs, source_dir, out_dir, confinement)`` -> the task's result as plain data.
Runner = Callable[["ShardTask", dict[str, Any], Path, Path, FileConfinement], dict[str, Any]]
#: ``reads(results)`` -> the task's inputs, from ``results(kind)``: the succeeded results of a kind of its job.
Reads = Callable[[Callable[[str], list[dict[str, Any]]]], dict[str, Any]]


@dataclass(frozen=True)
class TaskKind:
    """One kind of task; :data:`TASK_KINDS` holds them in the order a job's tasks run."""

    name: str
    description: str  #: for the API's task listing
    stage: Stage  #: the job stage its tasks count towards
    phase: int  #: its tasks' phase by default: a task starts once every task of its job of a lower phase succeeded
    runner: Runner
    reads: Reads | None = None
    is_shard: bool = False  #: its tasks are the job's shards (progress counts them and their planned bytes)
    drives_job: bool = True  #: False: the job stays its worker's, heartbeated by it, while its tasks run
    output: OutputDir = OutputDir.ATTEMPT
    outcome: Outcome = Outcome.RECORD


@dataclass(frozen=True)
class ShardTask:
    """One task as queued: ``kind`` (a :data:`TASK_KINDS` name) for one ``shard`` (or None), with its ``payload``
    (plain JSON: no paths, each worker resolves its own), at ``phase`` (by default its kind's)."""

    kind: str
    shard: str | None
    payload: Mapping[str, Any]
    phase: int | None = None

    def __post_init__(self) -> None:
        if self.phase is None:
            object.__setattr__(self, "phase", task_kind(self.kind).phase)

    @classmethod
    def of(cls, stored: Task) -> ShardTask:
        """The form of a task read from the store."""
        return cls(stored.kind, stored.shard, stored.payload, stored.phase)

    def to_dict(self) -> dict[str, Any]:
        return {"version": TASK_FORM_VERSION, "kind": self.kind, "shard": self.shard, "phase": self.phase,
                "payload": dict(self.payload)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardTask:
        """The task ``data`` describes (:meth:`to_dict`'s form; ``version`` and ``phase`` may be left out).

        Raises:
            ConversionError: another version, an unknown kind or key.
        """
        version = data.get("version", 1)
        if version != TASK_FORM_VERSION:
            raise ConversionError(f"a task in form version {version!r}; this release of fp8forge reads version "
                                  f"{TASK_FORM_VERSION}: run the job on workers of the release that queued it")
        unknown = sorted(set(data) - {"version", "kind", "shard", "phase", "payload"})
        if unknown:
            raise ConversionError(f"a task with unknown keys {unknown}")
        return cls(kind=data["kind"], shard=data.get("shard"), payload=dict(data["payload"]), phase=data.get("phase"))


def task_kind(name: str) -> TaskKind:
    """The registered kind ``name``.

    Raises:
        ConversionError: no such kind (a task queued by another release of fp8forge).
    """
    kind = TASK_KINDS.get(name)
    if kind is None:
        raise ConversionError(f"task kind {name!r} is not one this release of fp8forge runs (known: "
                              f"{', '.join(TASK_KINDS)}); submit the job again")
    return kind


def run_task(task: ShardTask, inputs: dict[str, Any], source_dir: Path, out_dir: Path,
             confinement: FileConfinement) -> dict[str, Any]:
    """Run ``task`` here (``inputs``: what its kind reads of earlier tasks); returns its result as plain data."""
    return task_kind(task.kind).runner(task, inputs, source_dir, out_dir, confinement)


def plan_payload(request: Mapping[str, Any]) -> dict[str, Any]:
    """The payload of a requantize job's ``plan`` task, from the job's request (``model``, ``requantize.to`` and the
    optional ``include``, ``exclude``, ``skip_first_last``, ``requantize.measure``): what
    ``converters.modelfree.stored`` reads where the task runs."""
    requantize = request["requantize"]
    return {"model": request["model"], "target": requantize["to"], "include": list(request.get("include") or ()),
            "exclude": list(request.get("exclude") or ()), "skip_first_last": request.get("skip_first_last", True),
            "measure": requantize.get("measure") is not False}


def task_kinds_description() -> str:
    """The kinds as the API documents them."""
    return "; ".join(f"{kind.name}: {kind.description}" for kind in TASK_KINDS.values()) + "."


# -- runners: the converters (and torch) load only in the process that runs a task --------------------------------
def _model_free(task: ShardTask, inputs: dict[str, Any], source_dir: Path, out_dir: Path,
                confinement: FileConfinement) -> dict[str, Any]:
    from converters.modelfree.stored import run_stored_task  # torch: only in the process that runs the task

    return run_stored_task(task.kind, dict(task.payload), inputs, source_dir, out_dir, confinement)


def _serving(task: ShardTask, inputs: dict[str, Any], source_dir: Path, out_dir: Path,
             confinement: FileConfinement) -> dict[str, Any]:
    from converters.pipeline.serving_export import run_serving_write  # torch, as above

    return run_serving_write(str(task.shard), dict(task.payload), source_dir, out_dir)


def _report(results: Callable[[str], list[dict[str, Any]]]) -> dict[str, Any]:
    return results("plan")[0]["report"]


def _write_reads(results: Callable[[str], list[dict[str, Any]]]) -> dict[str, Any]:
    report, amax = _report(results), results("amax")
    return {"amax": amax, "quantized": report["quantized"]} if amax else {}


def _finish_reads(results: Callable[[str], list[dict[str, Any]]]) -> dict[str, Any]:
    return {"report": _report(results), "writes": results("write")}


#: The name of a calibrated job's serving export shard task.
SERVING_WRITE = "serving_write"
TASK_KINDS: dict[str, TaskKind] = {kind.name: kind for kind in (
    TaskKind("plan", "a requantize job's inventory and decisions from the headers, which queue its other tasks",
             Stage.ANALYZE, 0, _model_free, outcome=Outcome.ADDS_TASKS),
    TaskKind("amax", "the largest |w| of each converted weight of one shard (formats that need it)",
             Stage.CONVERT, 1, _model_free),
    TaskKind("write", "one shard of a requantize job's checkpoint", Stage.CONVERT, 2, _model_free,
             reads=_write_reads, is_shard=True, outcome=Outcome.UPLOADS_FILE),
    TaskKind("finish", "a requantize job's index, config, side files and manifest, then publishes it",
             Stage.EXPORT, 3, _model_free, reads=_finish_reads, outcome=Outcome.PUBLISHES),
    TaskKind(SERVING_WRITE, "one weight file of a calibrated job's serving export, for the conversion that queued "
             "it", Stage.EXPORT, 0, _serving, is_shard=True, drives_job=False, output=OutputDir.STAGING),
)}
