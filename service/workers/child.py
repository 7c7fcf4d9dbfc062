"""The process that runs one conversion and reports back to its worker over a pipe: a fork of the worker's fork
server (``service.workers.task_server``), which has imported torch and the pipeline already.

This is the one place where ``service`` meets ``converters`` (and thus torch): the worker process itself
stays free of CUDA state, so killing this child is always a safe way to stop a run.

The messages it sends are the typed ones of ``service.workers.messages``.

Before anything imports torch the child limits the CPU threads its math libraries use to a budget
(``conversion_threads``; by default every CPU it may use but one), so a conversion leaves the API process a
core: with torch's OpenMP pool on every core, clients polling the API slow calibration many times over, the
threads of both fighting over the same cores (benchmarks/ measure it).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import traceback
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from converters.errors import Fp8ForgeError
from converters.model.sources import ModelSourceOptions
from converters.pipeline.progress import RESOLVE_STEPS, START_STEP, Unit
from converters.pipeline.request import ConversionRequest
from converters.pipeline.state import Stage
from converters.third_party_noise import silence_third_party_noise
from service.errors import disk_full
from service.redaction import server_directories, without_server_paths
from service.workers.messages import DISK_FULL, Failed, Progress, StageStarted, Succeeded, Warned
from service.workers.procs import configure_logging, die_with_worker
from service.workers.shard_export import ShardExportOptions
from service.workers.task_server import adopt_worker_environment

__all__ = ["PipeSink", "child_main", "cpu_quota", "failure_of", "hidden_directories", "limit_threads",
           "thread_budget", "usable_cpus"]

logger = logging.getLogger(__name__)

# Read by OpenMP (torch's intra-op pool), MKL, OpenBLAS and Rust's rayon (tokenizers) when they start their pools
_THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "RAYON_NUM_THREADS")
_CGROUP = Path("/sys/fs/cgroup")


def cpu_quota(cgroup: Path = _CGROUP) -> float | None:
    """CPUs a cgroup CPU limit allows (``docker --cpus``, a Kubernetes CPU limit); None when there is none.

    Reads cgroup v2 ``cpu.max``, else v1 ``cpu/cpu.cfs_quota_us``, at ``cgroup``: a container sees its own
    cgroup there. A quota does not show in the affinity mask, so without this a container limited to two CPUs
    on a 64-core host would start 63 threads.
    """
    try:
        quota, period = (cgroup / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        try:
            quota = (cgroup / "cpu" / "cpu.cfs_quota_us").read_text().strip()
            period = (cgroup / "cpu" / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    try:
        return int(quota) / int(period) if int(quota) > 0 and int(period) > 0 else None
    except ValueError:  # "max": no limit
        return None


def usable_cpus(cgroup: Path = _CGROUP) -> int:
    """CPUs this process may run on: its affinity mask (taskset, cpusets), capped by a cgroup CPU quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    quota = cpu_quota(cgroup)
    return max(1, min(cpus, math.ceil(quota)) if quota is not None else cpus)


def thread_budget(configured: int | None, cpus: int | None = None, *, conversions: int = 1) -> int:
    """The CPU threads one conversion may use: ``configured``, else all ``cpus`` (default: usable) but one,
    shared out among the ``conversions`` that may run at once on this host."""
    if configured is not None:
        return configured
    return max(1, ((usable_cpus() if cpus is None else cpus) - 1) // conversions)


def limit_threads(configured: int | None) -> int:
    """Hold this process's math libraries to :func:`thread_budget` threads; returns the budget.

    Call it before torch is imported: OpenMP, MKL and rayon size their pools from the environment when they
    load. torch's own pools are set as well, which also covers a torch that was imported earlier.
    """
    threads = thread_budget(configured)
    for name in _THREAD_VARIABLES:
        os.environ[name] = str(threads)
    # OpenMP threads that spin at each barrier burn the time slices of a host whose cores are shared (several times
    # slower on a loaded host, alike on a quiet one: docs/benchmarks/calibration-speed-2026-12-02.md).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # only possible before torch's first inter-op work, i.e. torch was in use already
        logger.warning("torch's inter-op thread pool had already started; it keeps %d threads",
                       torch.get_num_interop_threads())
    return threads


class PipeSink:
    """``converters.pipeline.driver.ProgressSink`` that forwards everything to the worker."""

    def __init__(self, conn: Connection, stop: Event, directories: list[tuple[str, str]] | None = None) -> None:
        self._conn = conn
        self._stop = stop
        self._directories = directories or []  # server paths kept out of what reaches clients

    def stage(self, name: str) -> None:
        self._conn.send(StageStarted(str(name)))

    def progress(self, done: int, total: int, unit: str = "step", **detail: Any) -> None:
        self._conn.send(Progress(int(done), int(total), str(getattr(unit, "value", unit)), detail))

    def warning(self, message: str) -> None:
        self._conn.send(Warned(without_server_paths(str(message), self._directories)))

    def should_stop(self) -> bool:
        return self._stop.is_set()


def child_main(
    request: dict[str, Any], out_dir: str, sources: dict[str, Any], conn: Connection, stop: Event,
    worker_pid: int, threads: int | None = None, log_level: str = "info",
    shard_export: ShardExportOptions | None = None, resume_dir: str | None = None,
    environ: dict[str, str] | None = None,
) -> None:
    """Run ``converters.pipeline.driver.run_conversion`` for one job with ``threads`` CPU threads; never raises.

    ``threads`` None: every CPU this process may use but one (see :func:`thread_budget`). fp8forge's own loggers
    log from ``log_level`` up. A full disk is reported as ``disk_full``, which the worker retries elsewhere.
    ``shard_export``: the serving export's weight files as shard tasks (``service.workers.serving_shards``).
    Started as a rank (RANK, WORLD_SIZE, ... in the environment: the Slurm executor's ranks) or with ``resume_dir``,
    the run is ``converters.distributed.run_ranked_conversion`` (docs/distributed.md): ranks other than 0 calibrate
    their share and report success with no files. ``resume_dir`` (one per job) keeps the per-layer resume record
    across attempts; without it there is none. ``environ``: the worker's environment when it started this child
    (``service.workers.task_server.worker_environment``).
    """
    die_with_worker(worker_pid)
    adopt_worker_environment(environ)  # before the rank variables and the thread budget are read
    # Ctrl-C reaches the whole process group; the worker decides how this run stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_logging(log_level, "conversion")

    silence_third_party_noise()  # a spawned child (a Slurm rank's) starts without its worker's filters
    directories = hidden_directories(out_dir, sources)
    try:
        # a spawned process's first seconds were its imports (a fork of the server has them): resolve's, and said so
        # (the pipeline's own start of resolve follows; its worker keeps this one)
        conn.send(StageStarted(Stage.RESOLVE.value))
        conn.send(Progress(0, len(RESOLVE_STEPS), Unit.STEP.value, {"step": START_STEP}))
        logger.info("conversion uses %d CPU threads", limit_threads(threads))  # before torch's pools start
        from converters.distributed import run_ranked_conversion  # imports torch: only in the process that converts
        from service.workers.serving_shards import QueuedServingShards  # torch as well

        options = ModelSourceOptions(**sources)
        shards = QueuedServingShards(shard_export, Path(out_dir), options, stop) if shard_export else None
        result = run_ranked_conversion(ConversionRequest.from_dict(request), Path(out_dir), options,
                                       PipeSink(conn, stop, directories), serving_shards=shards,
                                       resume_dir=Path(resume_dir) if resume_dir else None,
                                       resume=resume_dir is not None)  # out_dir is per attempt: no record beside it
        conn.send(Succeeded([dict(m) for m in result.manifest] if result is not None else []))
    except BaseException as exc:  # noqa: BLE001 - the worker must learn why, whatever happened
        failure = failure_of(exc)
        conn.send(dataclasses.replace(failure, message=without_server_paths(failure.message, directories)))
    finally:
        conn.close()


def hidden_directories(out_dir: str, sources: dict[str, Any]) -> list[tuple[str, str]]:
    """The server's directories a client message must not name: the job's output, the data directory and key
    file (the sources' private paths) and the hub cache."""
    private = [Path(path) for path in sources.get("private_paths", ())]
    named = server_directories(data_dir=Path(out_dir), cache_dir=sources.get("cache_dir"))
    named = [(path, "<artifact dir>" if placeholder == "<data dir>" else placeholder) for path, placeholder in named]
    for path in private:
        named += server_directories(data_dir=path, cache_dir=sources.get("cache_dir"))
    return sorted(set(named), key=lambda pair: -len(pair[0]))


def failure_of(exc: BaseException) -> Failed:
    """Why the run failed, for the worker: a full disk (whoever raised it, a library or fp8forge wrapping an
    ``OSError``), a conversion error, or a crash (whose text stays in this log)."""
    if disk_full(exc):  # not the job's fault: this host has no room, another may
        logger.warning("the disk is full: %s: %s", type(exc).__name__, exc)
        return Failed(DISK_FULL, "the worker's disk filled up while the conversion wrote its files")
    if isinstance(exc, Fp8ForgeError):
        return Failed(exc.code, exc.message)
    logger.error("conversion crashed:\n%s", "".join(traceback.format_exception(exc)))
    return Failed("internal_error", f"{type(exc).__name__}: {exc}")
