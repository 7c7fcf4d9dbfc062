"""Whether a calibrated job's serving export runs as shard tasks (``service.workers.serving_shards``), and what its
conversion child needs for it. Torch-free: the worker decides before it spawns the child.

When (``FP8FORGE_SHARD_EXPORT``): ``off`` never; ``on`` whenever serving formats are requested; ``auto`` when the
job store is a database server (several workers may share the work), the artifacts are on the data directory (the
workers write into the conversion's staging directory: with the object store each host's is its own) and the
model has more than one weight file. With SQLite and one worker the job runs as it always did.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from service.config import Settings
from service.jobs import Job
from service.store.host_faults import this_host
from service.store.schema import StoreTimeouts

__all__ = ["ShardExportOptions", "shard_export_options"]


@dataclass(frozen=True)
class ShardExportOptions:
    """What the conversion child needs to hand its serving shards to the job store (plain data: it is spawned)."""

    only_several_files: bool  #: ``auto``: a one-file export gains nothing from tasks
    store_url: str
    store_timeouts: dict[str, float]
    job_id: str
    attempt: int
    worker_id: str
    host: str  #: the worker's host's name in the store (``this_host``): the conversion claims shards as it
    source: str  #: the job's model reference, which each task resolves on its own worker
    max_attempts: int
    heartbeat_interval_s: float
    heartbeat_timeout_s: float


def shard_export_options(settings: Settings, job: Job, worker_id: str) -> ShardExportOptions | None:
    """The options when ``job``'s serving export may run as shard tasks under ``settings``; None when it may not."""
    mode = settings.shard_export
    if mode == "off" or not job.request.get("serving_formats"):
        return None
    if mode == "auto" and (settings.store_url.startswith("sqlite") or settings.artifact_store != "local"):
        return None
    timeouts = StoreTimeouts(lock_s=settings.store_lock_timeout_s, statement_s=settings.store_statement_timeout_s,
                             idle_in_transaction_s=settings.store_idle_in_transaction_timeout_s)
    return ShardExportOptions(only_several_files=mode == "auto", store_url=settings.store_url,
                              store_timeouts=asdict(timeouts), job_id=job.id, attempt=job.attempt,
                              worker_id=worker_id, host=this_host(settings.data_dir), source=job.request["model"],
                              max_attempts=settings.max_attempts, heartbeat_interval_s=settings.heartbeat_interval_s,
                              heartbeat_timeout_s=settings.heartbeat_timeout_s)
