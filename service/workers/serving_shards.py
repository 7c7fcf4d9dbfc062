"""A calibrated job's serving export as shard tasks: its conversion child, once calibration has set the scales,
queues one ``serving_write`` task per weight file and format in ``job_tasks``, then waits for them while any
worker (on any host sharing the data directory) claims them; the child claims and writes its own job's queued
shards meanwhile, so a job never waits for a free worker. Then the conversion writes each format's index, config
and side files, audits the export and finishes as usual (``converters.pipeline.serving_export``).

The job is not split: it stays its worker's, heartbeated by it (``JobStore.find_stale`` watches it). A shard
whose worker dies is requeued by the reaper and written again; one that fails fails the job.

When it runs so: ``service.workers.shard_export``. This module runs in the conversion child (it loads torch).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

from converters.artifact.layout import staging_dir_for
from converters.errors import ConversionCancelled, ConversionError, Fp8ForgeError
from converters.model.sources import ModelSourceOptions, confinement_for, resolve_model_dir
from service.jobs import Task, TaskStatus
from service.store import JobStore
from service.store.schema import StoreTimeouts
from service.workers.shard_export import ShardExportOptions
from service.workers.task_kinds import ShardTask, run_task

__all__ = ["QueuedServingShards"]

logger = logging.getLogger(__name__)

_POLL_S = 0.2


class QueuedServingShards:
    """``converters.pipeline.serving_export.ServingShardRunner`` over the job store's task queue.

    Args:
        options: from ``service.workers.shard_export.shard_export_options``.
        out_dir: the job attempt's directory (the conversion writes into its staging sibling).
        sources: this worker's model sources (``ModelSourceOptions``), to read the source's files.
        stopping: true once the run must stop (a cancel): the wait raises ``ConversionCancelled``.
    """

    def __init__(self, options: ShardExportOptions, out_dir: Path, sources: ModelSourceOptions,
                 stopping: Any) -> None:
        self.options, self.staging, self.sources, self.stopping = options, staging_dir_for(out_dir), sources, stopping

    def wanted(self, weight_files: int) -> bool:
        return weight_files > 1 or not self.options.only_several_files

    def run(self, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Queue ``tasks``, write this job's unclaimed ones here, wait for the others; their results in order."""
        o = self.options
        store = JobStore(o.store_url, timeouts=StoreTimeouts(**o.store_timeouts))
        try:
            if not store.tasks.add_serving_writes(o.job_id, o.worker_id, o.attempt, source=o.source, tasks=tasks,
                                                  max_attempts=o.max_attempts):
                raise ConversionCancelled("the job is no longer this worker's; its serving export stops")
            logger.info("job %s: %d serving shard tasks queued", o.job_id, len(tasks))
            try:
                return self._wait(store)
            except BaseException:
                store.tasks.drop(o.job_id)  # what nobody runs yet never will; running ones stop by their heartbeat
                raise
        finally:
            store.close()

    def _wait(self, store: JobStore) -> list[dict[str, Any]]:
        o = self.options
        while True:
            if self.stopping.is_set():
                raise ConversionCancelled("cancelled while the serving export's shards were written")
            tasks = store.tasks.serving_writes(o.job_id, o.attempt)
            failed = [task for task in tasks if task.status is TaskStatus.FAILED]
            if failed:  # its worker has failed the job already, naming why; this is the conversion's own account
                raise ConversionError(f"serving export: {failed[0].name} failed; the job's events say why",
                                      field="serving_formats")
            if any(task.status is TaskStatus.CANCELLED for task in tasks):  # only a cancelled or ended job's are
                raise ConversionCancelled("the serving export's shard tasks were dropped: the job was cancelled")
            if all(task.status is TaskStatus.SUCCEEDED for task in tasks):
                return [dict(task.result or {}) for task in tasks]
            task = store.tasks.claim(o.worker_id, o.host, job_id=o.job_id,  # the job has no other kind
                                     live_within_s=o.heartbeat_timeout_s)
            if task is None:
                time.sleep(_POLL_S)
                continue
            self._write_here(store, task)

    def _write_here(self, store: JobStore, task: Task) -> None:
        """Write a claimed shard in this process, heartbeating it from a thread; record its result."""
        o = self.options
        done = threading.Event()

        def beat() -> None:
            while not done.wait(o.heartbeat_interval_s):
                store.tasks.heartbeat(task, o.worker_id)

        beater = threading.Thread(target=beat, name=f"fp8forge-shard-{task.seq}-beat", daemon=True)
        beater.start()
        try:
            source_dir = resolve_model_dir(o.source, self.sources, with_weights=True)
            result = run_task(ShardTask.of(task), {}, source_dir, self.staging, confinement_for(self.sources))
        except Fp8ForgeError as exc:
            store.tasks.release(task, TaskStatus.FAILED, worker_id=o.worker_id, error=(exc.code, exc.message))
            raise
        except BaseException:
            store.tasks.release(task, TaskStatus.FAILED, worker_id=o.worker_id,
                                error=("internal_error", "the conversion's own write of this shard crashed"))
            raise
        finally:
            done.set()
            beater.join()
        if store.tasks.succeed(task, o.worker_id, result):
            logger.info("job %s: %s written by the conversion itself", o.job_id, task.name)
