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

__all__ = ["LOG_LEVELS", "configure_logging", "die_with_parent", "visible_gpus"]

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
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
        except (OSError, AttributeError):
            logger.debug("prctl unavailable; relying on the parent watcher")

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os.kill(os.getpid(), sig)

    if os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def visible_gpus() -> list[str]:
    """CUDA device ids this machine offers, without importing torch (CUDA_VISIBLE_DEVICES, else /proc)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and not d.strip().startswith("-")]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []
