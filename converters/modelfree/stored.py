"""The phases of a model-free conversion run one at a time from stored tasks (a job queue's shard tasks).

A job queue stores each task (kind, shard, phase, payload: plain JSON) and hands one, with the
results of the tasks it depends on, to :func:`run_stored_task` on whichever machine claims it. The kinds, their
phases, the task form and the plan task's payload are the task registry's (``service.workers.task_kinds``, which the
torch-free worker reads); a plan task's result lists the tasks it queues as ``{"kind", "shard", "payload"}``, which
the registry reads in its form. The kinds, in the order their phases run:

* ``plan``: inventory and decide (headers only); its result is the report and the tasks of the later phases;
* ``amax`` (per shard, formats that need the weight amax): :func:`~converters.modelfree.tasks.shard_weight_amax`;
* ``write`` (per shard): the reduce of every ``amax`` result over the fused groups (cheap: one number per
  weight), then :func:`~converters.modelfree.tasks.write_shard`; the result adds the file's size and sha256;
* ``finish``: index, config, side files, report and manifest (:func:`~converters.modelfree.driver.finish`).

A task may start once every task of the job of an earlier phase has succeeded. Paths are not stored:
each machine resolves the source and names its own output directory, so a payload's ``source_dir`` and
``out_dir`` are filled in where it runs. The bytes written are those of :func:`convert_model_free`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from converters.model.files import FileConfinement
from converters.modelfree.driver import _plan, check_plan, finish, shard_tasks, with_weight_amax
from converters.modelfree.eligibility import ModelFreeOptions
from converters.modelfree.tasks import (
    AmaxResult,
    AmaxTask,
    WriteResult,
    WriteTask,
    reduce_weight_amax,
    shard_weight_amax,
    write_shard,
)

__all__ = ["run_stored_task"]


def run_stored_task(kind: str, payload: dict[str, Any], inputs: dict[str, Any], source_dir: Path, out_dir: Path,
                    confinement: FileConfinement) -> dict[str, Any]:
    """Run one stored task; returns its result as plain data.

    Args:
        inputs: what the task reads of earlier phases: ``write`` takes ``amax`` (the amax tasks' results) and
            ``quantized`` (the report's weight -> group map); ``finish`` takes ``report`` and ``writes``.
        source_dir: the source checkpoint as this machine sees it. out_dir: where this machine writes.

    Raises:
        Fp8ForgeError: bad options, a source that cannot be read, nothing to convert (as ``convert_model_free``).
    """
    if kind == "plan":
        return _plan_tasks(source_dir, payload)
    if kind == "amax":
        task = AmaxTask.from_dict({**payload, "source_dir": str(source_dir)})
        return shard_weight_amax(task).to_dict()
    if kind == "write":
        amax = reduce_weight_amax([AmaxResult.from_dict(result) for result in inputs.get("amax", ())],
                                  inputs.get("quantized", {}))
        task = with_weight_amax(WriteTask.from_dict({**payload, "source_dir": str(source_dir),
                                                     "out_dir": str(out_dir)}), amax)
        return write_shard(task).to_dict()  # its "file": the manifest's entry of the shard, hashed as it was written
    if kind == "finish":
        return _finish_task(source_dir, out_dir, inputs, confinement)
    raise ValueError(f"unknown task kind {kind!r}; a requantize job's kinds are plan, amax, write and finish")


def _plan_tasks(source_dir: Path, payload: dict[str, Any]) -> dict[str, Any]:
    # a payload queued by a release before ``measure`` measured
    options = ModelFreeOptions(include=tuple(payload["include"]), exclude=tuple(payload["exclude"]),
                               skip_first_last=payload["skip_first_last"], measure=payload.get("measure", True))
    report, view = _plan(source_dir, payload["target"], options, None)
    check_plan(report, view)
    amax_tasks, write_tasks = shard_tasks(source_dir, Path(), report, view)
    tasks = [_stored("amax", task.shard, task.to_dict()) for task in amax_tasks]
    tasks += [_stored("write", task.shard, task.to_dict()) for task in write_tasks]
    tasks.append(_stored("finish", None, {}))
    return {"report": report, "tasks": tasks}


def _stored(kind: str, shard: str | None, payload: dict[str, Any]) -> dict[str, Any]:
    """A task in the registry's form, its phase its kind's (paths left out: each machine resolves its own)."""
    payload = {name: value for name, value in payload.items() if name not in ("source_dir", "out_dir")}
    return {"kind": kind, "shard": shard, "payload": payload}


def _finish_task(source_dir: Path, out_dir: Path, inputs: dict[str, Any], confinement: FileConfinement
                 ) -> dict[str, Any]:
    """Write the job's remaining files into ``out_dir`` beside whichever shards are there; returns the manifest.

    What a killed writer left in ``out_dir`` (a temporary file, a shard no task wrote) is removed first, so the
    directory then holds exactly what the manifest lists.
    """
    results = [WriteResult.from_dict(result) for result in inputs["writes"]]
    shard_files = [result.file for result in results]
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = {entry["name"]: entry["bytes"] for entry in shard_files}
    for path in out_dir.iterdir():
        if path.is_file() and wanted.get(path.name) != path.stat().st_size:
            os.remove(path)
    manifest = finish(source_dir, out_dir, inputs["report"], results, confinement, shard_files=shard_files)
    return {"manifest": manifest}
