"""Task results too large for a ``job_tasks.result`` row, kept in a file in the job attempt's scratch area.

A plan task's result is its job's report: an entry per tensor of the source, a few hundred bytes each, so tens of
megabytes for a checkpoint of 100,000 tensors (DeepSeek-V3 has about 91,000). Every later task of the job reads it
back (``TaskRun._inputs``), and a row that size is read whole by every database query that selects it. A result
over :data:`MAX_RESULT_ROW_BYTES` is written to a file in the attempt's staging directory, the hidden sibling of
its output directory that is never published and goes with the attempt (``ArtifactStorage.remove_attempt``, the
sweeper of orphaned attempts, a deleted job); the row holds a reference to it (:func:`stored_result`), which
:func:`loaded_result` follows.

Split jobs on local artifact storage share the jobs directory between their workers (the finish task publishes
the attempt's directory by renaming it), so every task of the job finds the file. With an object store the
scratch directory is one host's local disk, which the job's other tasks may not share: there a result stays in
its row, whatever its size.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

from service.artifacts import ArtifactStorage

__all__ = ["MAX_RESULT_ROW_BYTES", "TaskResultMissing", "loaded_result", "stored_result"]

#: A result row up to a megabyte (a write task's: a shard's name, size, hash and a few counts) stays in the row.
MAX_RESULT_ROW_BYTES = 1 << 20
_REFERENCE = "result_file"


class TaskResultMissing(RuntimeError):
    """The file a task result row refers to is gone or not the one written."""


def stored_result(dirs: ArtifactStorage, job_id: str, attempt: int, seq: int, result: Mapping[str, Any]
                  ) -> Mapping[str, Any]:
    """What the row of task ``seq`` (of the job's ``attempt``) holds for ``result``: the result itself when it is
    small or the artifacts are in an object store, else a reference to the file it was written to (atomically)."""
    encoded = json.dumps(result, separators=(",", ":")).encode()
    if len(encoded) <= MAX_RESULT_ROW_BYTES or dirs.remote:
        return result
    directory = dirs.staging_dir(job_id, attempt)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"task-{seq}.result.json"
    temporary = directory / f".{name}.tmp"
    with open(temporary, "wb") as handle:
        handle.write(encoded)
        handle.flush()
        os.fsync(handle.fileno())  # the row commits after this; a reader on another host must find the bytes
    os.replace(temporary, directory / name)
    return {_REFERENCE: {"attempt": attempt, "name": name, "bytes": len(encoded),
                         "sha256": hashlib.sha256(encoded).hexdigest()}}


def loaded_result(dirs: ArtifactStorage, job_id: str, stored: Mapping[str, Any]) -> dict[str, Any]:
    """The result a row holds: ``stored`` itself, or the file :func:`stored_result` wrote, checked against the
    size and hash the row recorded.

    Raises:
        TaskResultMissing: the file is gone (its attempt was removed) or holds other bytes.
    """
    reference = stored.get(_REFERENCE)
    if not isinstance(reference, dict):
        return dict(stored)
    path = dirs.staging_dir(job_id, reference["attempt"]) / reference["name"]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TaskResultMissing(f"job {job_id}: the task result file {path.name} cannot be read: {exc}") from exc
    if len(data) != reference["bytes"] or hashlib.sha256(data).hexdigest() != reference["sha256"]:
        raise TaskResultMissing(f"job {job_id}: the task result file {path.name} is not the one written")
    return json.loads(data)
