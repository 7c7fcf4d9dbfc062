"""The fork server that conversion and task children start from: torch, transformers, torchao and the converters
are imported once per worker, and each job's or task's process is a fork of that server instead of a fresh
interpreter.

A spawned child imported torch and the converters on every job and task (seconds each), which dominated a small
shard's task and delayed every job's first step. A fork of a process that has imported them but never ran
anything starts in a fraction of that, and keeps what the spawn gave: the server is a single-threaded process that
holds no CUDA context, no store connection and no lock, so each child starts from the same clean image (nothing
one job or task does reaches the next);
the server is the worker's own child and exits when the worker's end of its pipe closes (a kill -9 included),
and each child dies with it (``service.workers.procs.die_with_worker``).

The server starts with the worker's first job or task, not with the worker: a worker that runs nothing never pays
for its imports. A child's environment is its worker's at the start of the child (``worker_environment``), as a
spawned child's was; what a library read from it at import stays as the server read it, the worker's own
environment at the server's start. Its preload is :mod:`service.workers.task_server_preload`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

__all__ = ["PRELOAD", "adopt_worker_environment", "start_task_server", "task_context", "worker_environment"]

#: What the fork server imports before it forks its first child.
PRELOAD = "service.workers.task_server_preload"


def task_context() -> BaseContext:
    """The multiprocessing context task children start from (the fork server, with :data:`PRELOAD`)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload([PRELOAD])
    return context


def start_task_server() -> None:
    """Start the fork server now (it imports its preload in the background); it starts by itself otherwise."""
    task_context()
    forkserver.ensure_running()


def worker_environment() -> dict[str, str]:
    """What a child adopts (:func:`adopt_worker_environment`): the worker's environment now. The fork server's is
    the worker's at the server's start, and a worker may set variables later (a Slurm rank's RANK and
    MASTER_ADDR before its conversion, a test's settings)."""
    return dict(os.environ)


def adopt_worker_environment(environ: dict[str, str] | None) -> None:
    """In a child: take the worker's variables (``environ``), over the server's; None: keep the server's."""
    if environ is not None:
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update(environ)
