"""Process plumbing shared by the API, workers and their conversion children: logging set-up, parent-death links
and GPU discovery."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing import forkserver

__all__ = ["LOG_LEVELS", "configure_logging", "die_with_parent", "die_with_worker", "is_alive", "visible_gpus"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1

#: The levels ``--log-level`` accepts.
LOG_LEVELS = ("debug", "info", "warning", "error")
# fp8forge's own loggers; ``--log-level`` sets theirs, every other library logs from WARNING up
_OWN_LOGGERS = ("service", "converters")


def configure_logging(level: str, tag: str) -> None:
    """Log one timestamped line per record to stderr, tagged ``[tag]`` (which process of the service wrote it).

    fp8forge's own loggers (``service.*``, ``converters.*``) log from ``level`` (one of :data:`LOG_LEVELS`) up,
    other libraries from WARNING up. Replaces the configuration the process had: the ``fp8forge`` command sets a
    plain one before it knows which subcommand runs.
    """
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s",
                        force=True)
    for name in _OWN_LOGGERS:
        logging.getLogger(name).setLevel(level.upper())


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Make this process receive ``sig`` when ``parent_pid`` dies (even by ``kill -9``).

    On Linux the kernel does it (``prctl(PR_SET_PDEATHSIG)``); everywhere a daemon thread also watches
    ``getppid()``, which covers other systems and a parent that died before the prctl call.
    """
    _kill_with_parent(sig)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), sig)

    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def die_with_worker(worker_pid: int, sig: int = signal.SIGKILL) -> None:
    """:func:`die_with_parent` for a process the worker (or the API: its analysis children) started directly or
    through its fork server (``service.workers.task_server``).

    A fork server's child has the server as its parent: the kernel link goes to the server, and a daemon thread
    watches the worker itself. The server exits once every holder of its "alive" pipe's write end has closed it:
    the worker (a kill -9 included) and, as multiprocessing hands it to each, its children. This child closes its
    copy (it starts no forks of the server), so that the server goes with the worker and the kernel's link ends
    this child even where its own watcher cannot run (a stopped process).
    """
    if os.getppid() == worker_pid:
        die_with_parent(worker_pid, sig)
        return
    _kill_with_parent(sig)
    _release_fork_server()

    def watch() -> None:
        while is_alive(worker_pid):
            time.sleep(0.5)
        os.kill(os.getpid(), sig)

    if not is_alive(worker_pid):
        os.kill(os.getpid(), sig)
    threading.Thread(target=watch, name="worker-watch", daemon=True).start()


def _release_fork_server() -> None:
    """Close this fork server child's copy of the server's "alive" pipe (multiprocessing keeps it in the child's
    ``forkserver`` state so that the child may fork from the same server; none of fp8forge's children do)."""
    server = forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None


def is_alive(pid: int) -> bool:
    """Whether process ``pid`` runs; on Linux a zombie (dead, not yet reaped by its parent) counts as dead."""
    if sys.platform.startswith("linux"):
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
                return handle.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    return True


def _kill_with_parent(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (Linux); elsewhere a watcher does."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
        except (OSError, AttributeError):
            logger.debug("prctl unavailable; relying on the parent watcher")


def visible_gpus() -> list[str]:
    """CUDA device ids this machine offers, without importing torch (CUDA_VISIBLE_DEVICES, else /proc)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and not d.strip().startswith("-")]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []
