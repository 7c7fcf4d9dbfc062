"""What a conversion child tells its worker over the pipe, one typed message per event.

The child sends any number of ``StageStarted``, ``Progress`` and ``Warned`` messages, then exactly one
``Succeeded`` or ``Failed``. Messages are frozen dataclasses, so both ends agree on their fields and a reader
sees the whole protocol here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["DISK_FULL", "ChildMessage", "ChildResult", "Failed", "Progress", "StageStarted", "Succeeded", "TaskDone",
           "Warned"]

#: ``Failed.code`` of a run whose host ran out of disk space: not the job's fault, so another attempt may succeed.
DISK_FULL = "disk_full"


@dataclass(frozen=True)
class StageStarted:
    stage: str


@dataclass(frozen=True)
class Progress:
    done: int
    total: int
    unit: str = "step"  #: what done / total count (``converters.pipeline.progress.Unit``)
    detail: dict[str, Any] = field(default_factory=dict)  #: the event's optional fields (``step``, shards, bytes)


@dataclass(frozen=True)
class Warned:
    message: str


@dataclass(frozen=True)
class Succeeded:
    manifest: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Failed:
    code: str
    message: str


@dataclass(frozen=True)
class TaskDone:
    """A task child's result (``service.workers.task_child``): the task's plain-data result."""

    result: dict[str, Any]


ChildResult = Succeeded | Failed
ChildMessage = StageStarted | Progress | Warned | Succeeded | Failed
