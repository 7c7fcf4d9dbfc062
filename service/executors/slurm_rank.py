"""What runs inside a Slurm allocation of the service: ``python -m service.executors.slurm_rank MODE --settings FILE
JOB_ID``.

``calibrated``: one process per rank, started by ``srun``. Each rank gets the standard torch.distributed variables
from Slurm's (RANK=$SLURM_PROCID, WORLD_SIZE=$SLURM_NTASKS, LOCAL_RANK=$SLURM_LOCALID; MASTER_ADDR and MASTER_PORT
come from the batch script). Rank 0 claims the job in the store and runs it as a local worker does
(``service.workers.runner.JobRun``: the conversion child, heartbeats, events, cancel, publishing); every other rank
runs the same conversion entry point (``service.workers.child.child_main``) beside it, in its own scratch directory,
for the data-parallel calibration to join (docs/distributed.md), and stops when the job's attempt ends.

``tasks``: one process per task of a Slurm array; a worker that claims the job's shard tasks
(``service.workers.task_run.TaskRun``) until the job is over.

SIGTERM (Slurm's time limit, a ``scancel`` of the allocation) stops a rank as it stops a local worker: the running
attempt goes back to queued without using up an attempt, and the service submits it again.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

from sqlalchemy.exc import DBAPIError

from service.artifacts import open_storage
from service.config import Settings
from service.executors.slurm_options import conversion_fields
from service.jobs import JobStatus
from service.store import JobStore
from service.store.schema import brief
from service.store.tasks import this_host
from service.store.workers import WorkerRegistry
from service.workers.child import child_main
from service.workers.procs import configure_logging
from service.workers.runner import JobRun, ensure_dead
from service.workers.task_run import TaskRun
from service.workers.task_server import start_task_server

__all__ = ["main", "rendezvous_from_slurm", "resume_dir_of", "slurm_job_name"]

# by name: run as ``python -m`` this module is ``__main__``, outside the ``service`` loggers configure_logging sets
logger = logging.getLogger("service.executors.slurm_rank")

# How long a rank other than 0 waits for rank 0 to claim the job before it concludes there is nothing to join
_JOIN_WITHIN_S = 120.0


def rendezvous_from_slurm(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """The torch.distributed variables of this rank, from the ones ``srun`` sets (and the batch script's
    MASTER_ADDR / MASTER_PORT); outside ``srun``, the standard ones another launcher set (a JobSet's pods,
    torchrun), else the one rank of one."""
    def pick(slurm: str, standard: str, default: str) -> str:
        return environ.get(slurm) or environ.get(standard) or default

    return {"RANK": pick("SLURM_PROCID", "RANK", "0"), "WORLD_SIZE": pick("SLURM_NTASKS", "WORLD_SIZE", "1"),
            "LOCAL_RANK": pick("SLURM_LOCALID", "LOCAL_RANK", "0"),
            "MASTER_ADDR": environ.get("MASTER_ADDR", "127.0.0.1"), "MASTER_PORT": environ.get("MASTER_PORT", "29500")}


def slurm_job_name(environ: dict[str, str] | os._Environ[str] = os.environ) -> str:
    """This process's Slurm job as ``squeue`` shows it: ``<array id>_<task>`` in an array, else the job id (and the
    rank), so an operator can tell from a worker's name in the store which allocation it was."""
    if "SLURM_ARRAY_JOB_ID" in environ:
        return f"{environ['SLURM_ARRAY_JOB_ID']}_{environ.get('SLURM_ARRAY_TASK_ID', '')}"
    return f"{environ.get('SLURM_JOB_ID', 'none')}.{environ.get('SLURM_PROCID', '0')}"


def resume_dir_of(settings: Settings, job_id: str) -> Path:
    """The job's per-layer resume record (docs/distributed.md): one per job, on the directory every node shares, so
    the allocation after a time limit or a lost node continues at the first unfinished layer."""
    return settings.slurm_dir / job_id / "resume"


class _Member:
    """A worker identity in the store for this process, heartbeaten from its own thread until :meth:`close`."""

    def __init__(self, settings: Settings, job_id: str) -> None:
        self.settings, self.job_id = settings, job_id
        self.store = JobStore.from_settings(settings)
        self.dirs = open_storage(settings)
        self.dirs.ensure()
        self.worker_id = f"{WorkerRegistry.new_id()}:slurm-{slurm_job_name()}"
        self.host = this_host(settings.data_dir)
        self.stopping = threading.Event()
        self._done = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="fp8forge-slurm-beat", daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        while not self._done.wait(self.settings.heartbeat_interval_s):
            try:
                self.store.workers.heartbeat(self.worker_id, self.job_id, host=self.host)
            except DBAPIError as exc:
                logger.debug("heartbeat failed (%s)", brief(exc))

    def close(self) -> None:
        self._done.set()
        self._beat.join()
        try:
            self.store.workers.remove(self.worker_id)
        except DBAPIError:  # its row expires by itself
            logger.warning("could not remove %s from the store", self.worker_id, exc_info=True)
        self.store.close()


def run_calibrated(member: _Member, rank: int) -> int:
    settings, store = member.settings, member.store
    # A calibrated job's serving shards would wait for local workers that this executor does not run: the ranks'
    # own conversion writes them.
    settings = settings.model_copy(update={"shard_export": "off"})
    if rank != 0:
        return _join(member, settings)
    job = store.claim_next(member.worker_id, host=member.host, job_id=member.job_id)
    if job is None:
        logger.info("job %s: not queued (%s); nothing to run", member.job_id, store.get_job(member.job_id).status.value)
        return 0
    logger.info("job %s: claimed, attempt %d of %d", job.id, job.attempt, job.max_attempts)
    # the conversion child takes the conversion's fields alone (the request's slurm object was this executor's)
    job = dataclasses.replace(job, request=conversion_fields(job.request))
    status = JobRun(settings, store, member.dirs, member.worker_id, job, member.stopping, log_level="info",
                    resume_dir=resume_dir_of(settings, job.id)).execute()
    logger.info("job %s: %s", job.id, status.value if status else "lost")
    return 0


def _join(member: _Member, settings: Settings) -> int:
    """A rank other than 0: run the conversion beside rank 0's for as long as rank 0's attempt runs."""
    store, job_id = member.store, member.job_id
    job = store.get_job(job_id)
    waited = 0.0
    while job.status is JobStatus.QUEUED and waited < _JOIN_WITHIN_S and not member.stopping.is_set():
        member.stopping.wait(settings.poll_interval_s)
        waited += settings.poll_interval_s
        job = store.get_job(job_id)
    if job.status is not JobStatus.RUNNING:
        logger.info("job %s: %s; this rank has nothing to join", job_id, job.status.value)
        return 0
    scratch = settings.slurm_dir / job_id / f"rank-{os.environ['RANK']}-attempt-{job.attempt}"
    scratch.mkdir(parents=True, exist_ok=True)
    ctx = mp.get_context("spawn")
    receiver, sender = ctx.Pipe(duplex=False)
    stop = ctx.Event()
    proc = ctx.Process(target=child_main, name=f"fp8forge-rank-{os.environ['RANK']}",
                       args=(conversion_fields(job.request), str(scratch), settings.model_sources(), sender, stop,
                             os.getpid()),
                       kwargs={"log_level": "info", "resume_dir": str(resume_dir_of(settings, job_id)),
                               **({"threads": settings.conversion_threads} if settings.conversion_threads else {})})
    proc.start()
    sender.close()
    try:
        while proc.is_alive():
            # rank 0 reports the job; these are its echo. Drained for a bounded time, so a child reporting every
            # step cannot keep this loop from noticing that the attempt ended.
            until = time.monotonic() + settings.poll_interval_s
            while receiver.poll(max(0.0, until - time.monotonic())) and time.monotonic() < until:
                logger.debug("rank: %r", receiver.recv())
            now = store.get_job(job_id)
            if member.stopping.is_set() or now.status is not JobStatus.RUNNING or now.attempt != job.attempt:
                stop.set()
    except (EOFError, OSError):
        pass
    finally:
        ensure_dead(proc)
        receiver.close()
        shutil.rmtree(scratch, ignore_errors=True)  # rank 0 writes the job's files; this rank's are scratch
    return 0


def run_tasks(member: _Member) -> int:
    """An array task: claim and run the job's tasks until the job is no longer running."""
    settings, store = member.settings, member.store
    start_task_server(conversions=False)  # its imports (torch) run while this task looks for work
    while not member.stopping.is_set():
        status = store.get_job(member.job_id).status
        if status is not JobStatus.RUNNING:
            logger.info("job %s: %s; this array task is done", member.job_id, status.value)
            break
        task = store.tasks.claim(member.worker_id, member.host, job_id=member.job_id,
                                 live_within_s=settings.heartbeat_timeout_s)
        if task is None:  # its next phase waits for an earlier one (the plan, the last shard)
            member.stopping.wait(settings.poll_interval_s)
            continue
        ended = TaskRun(settings, store, member.dirs, member.worker_id, task, member.stopping,
                        log_level="info").execute()
        logger.info("job %s: %s: %s", task.job_id, task.name, ended.value if ended else "lost")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m service.executors.slurm_rank", description=__doc__)
    parser.add_argument("mode", choices=("calibrated", "tasks"))
    parser.add_argument("--settings", type=Path, required=True, help="the settings file the service wrote")
    parser.add_argument("job_id")
    args = parser.parse_args(argv)
    os.environ.update(rendezvous_from_slurm())  # before the conversion child starts: it inherits them
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    configure_logging("info", f"slurm {os.environ.get('SLURM_JOB_ID', '-')} rank {rank}")
    try:
        settings = Settings.model_validate_json(args.settings.read_text())
    except (OSError, ValueError) as exc:
        print(f"fp8forge slurm rank: cannot read the settings file {args.settings} ({exc}); the service writes it "
              "under FP8FORGE_SLURM_WORK_DIR, which every node must see", file=sys.stderr)
        return 2
    logger.info("job %s: rank %d of %d (local rank %s), rendezvous %s:%s", args.job_id, rank, world,
                os.environ["LOCAL_RANK"], os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])
    member = _Member(settings, args.job_id)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: member.stopping.set())
    try:
        return run_calibrated(member, rank) if args.mode == "calibrated" else run_tasks(member)
    finally:
        member.close()


if __name__ == "__main__":
    sys.exit(main())
