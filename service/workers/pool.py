"""The local worker processes of ``fp8forge serve``: started with ``spawn``, restarted when they crash.

A worker that exits cleanly (code 0) was asked to stop, typically by the Ctrl-C that reached the whole
process group, so it is not restarted; ``fp8forge serve`` also calls :meth:`WorkerPool.begin_stop` as soon
as it is told to shut down, before the API's graceful wait.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import threading
from multiprocessing.process import BaseProcess

from service.config import Settings
from service.executors.slurm_dispatch import SlurmDispatcher
from service.workers.child import thread_budget
from service.workers.procs import visible_gpus
from service.workers.worker import worker_process_main

__all__ = ["WorkerPool", "default_worker_count", "make_executor"]

logger = logging.getLogger(__name__)


def default_worker_count() -> int:
    """One worker per visible GPU, or one CPU worker where there is none."""
    return max(1, len(visible_gpus()))


def make_executor(settings: Settings, count: int, *, log_level: str = "info") -> WorkerPool | SlurmDispatcher:
    """What runs the jobs beside the API: ``count`` local workers, or with ``FP8FORGE_EXECUTOR=slurm`` the Slurm
    dispatcher in their place (``service.executors``). Both have ``start``, ``begin_stop`` and ``stop``."""
    if settings.executor == "slurm":
        return SlurmDispatcher(settings)
    return WorkerPool(settings, count, log_level=log_level)


class WorkerPool:
    """Keeps ``count`` worker processes alive until :meth:`stop`."""

    def __init__(self, settings: Settings, count: int, *, log_level: str = "info") -> None:
        if settings.conversion_threads is None and count > 1:
            # each worker runs one conversion at a time, so they share the cores the API leaves (with every
            # child on all but one core, three workers' conversions would fight over them threefold)
            settings = settings.model_copy(update={"conversion_threads": thread_budget(None, conversions=count)})
            logger.info("%d local workers: each conversion may use %d CPU threads", count,
                        settings.conversion_threads)
        self.settings = settings
        self.count = count
        self.log_level = log_level
        self._gpus = visible_gpus()
        self._ctx = mp.get_context("spawn")
        self._procs: list[BaseProcess | None] = [None] * count
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._supervise, name="fp8forge-pool", daemon=True)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs if p is not None and p.pid is not None]

    def start(self) -> None:
        for slot in range(self.count):
            self._spawn(slot)
        self._thread.start()

    def begin_stop(self) -> None:
        """Restart no worker from now on (the shutdown has begun); :meth:`stop` ends them."""
        self._stopping.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every worker (each requeues its running job), then kill the ones that linger."""
        self.begin_stop()
        if self._thread.is_alive():
            self._thread.join()
        procs = [p for p in self._procs if p is not None]
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout_s)
            if proc.is_alive():
                logger.warning("worker %s did not stop in %ss; killing it", proc.pid, timeout_s)
                proc.kill()
                proc.join()

    def _spawn(self, slot: int) -> None:
        gpu = self._gpus[slot % len(self._gpus)] if self._gpus else None
        proc = self._ctx.Process(target=worker_process_main, args=(self.settings, gpu, os.getpid(), self.log_level),
                                 name=f"fp8forge-worker-{slot}")
        proc.start()
        self._procs[slot] = proc
        logger.info("started worker %d (pid %s, gpu %s)", slot, proc.pid, gpu or "none")

    def _supervise(self) -> None:
        while not self._stopping.wait(1.0):
            self.check()

    def check(self) -> None:
        """Restart every worker that crashed; one that exited cleanly was told to stop and stays stopped."""
        with self._lock:
            for slot, proc in enumerate(self._procs):
                if proc is None or proc.is_alive() or self._stopping.is_set():
                    continue
                proc.join()
                if proc.exitcode == 0:
                    logger.info("worker %d (pid %s) stopped", slot, proc.pid)
                    self._procs[slot] = None
                    continue
                logger.warning("worker %d (pid %s) exited with %s; restarting it", slot, proc.pid, proc.exitcode)
                self._spawn(slot)
