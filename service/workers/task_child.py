"""The process that runs one stored task of any kind (``service.workers.task_kinds.run_task``), forked from the
worker's task server (``service.workers.task_server``), which has imported torch and the converters already.

Like the conversion child (``service.workers.child``) it is the place where ``service`` meets ``converters`` and
torch; it resolves the job's source through this worker's own model sources (its allowed roots, its hub cache),
runs the task, and sends one ``TaskDone`` or ``Failed`` back.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from converters.model.sources import ModelSourceOptions
from converters.third_party_noise import silence_third_party_noise
from service.redaction import without_server_paths
from service.workers.child import failure_of, hidden_directories, limit_threads
from service.workers.messages import TaskDone
from service.workers.procs import configure_logging, die_with_worker
from service.workers.task_kinds import ShardTask, run_task

__all__ = ["task_child_main"]

logger = logging.getLogger(__name__)


def task_child_main(
    task: dict[str, Any], source: str, inputs: dict[str, Any], out_dir: str, sources: dict[str, Any],
    conn: Connection, worker_pid: int, threads: int | None = None, log_level: str = "info",
) -> None:
    """Run one task (``ShardTask.to_dict``'s form) with ``threads`` CPU threads, writing into ``out_dir``; never
    raises (see ``child_main``)."""
    die_with_worker(worker_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worker decides how this run stops
    configure_logging(log_level, f"task {task.get('kind')}")
    silence_third_party_noise()
    directories = hidden_directories(out_dir, sources)
    try:
        limit_threads(threads)  # torch is loaded already (the task server): this sets its pools' sizes
        from converters.model.sources import confinement_for, resolve_model_dir  # hub client: only here

        options = ModelSourceOptions(**sources)
        source_dir = resolve_model_dir(source, options, with_weights=True)
        result = run_task(ShardTask.from_dict(task), inputs, source_dir, Path(out_dir), confinement_for(options))
        conn.send(TaskDone(result))
    except BaseException as exc:  # noqa: BLE001 - the worker must learn why, whatever happened
        failure = failure_of(exc)
        conn.send(dataclasses.replace(failure, message=without_server_paths(failure.message, directories)))
    finally:
        conn.close()
