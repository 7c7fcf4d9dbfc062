"""The fork server that task children start from: torch, safetensors and the task code are imported once per
worker, and each task's process is a fork of that server instead of a fresh interpreter.

A spawned task child imported torch and the converters on every task (seconds each), which dominated a small
shard's task. A fork of a process that has imported them but never ran anything starts in a fraction of that,
and keeps what the spawn gave: the server is a single-threaded process that holds no CUDA context, no store
connection and no lock, so each child starts from the same clean image (nothing one task does reaches the next);
the server is the worker's own child and exits when the worker's end of its pipe closes (a kill -9 included),
and each child dies with it (``service.workers.procs.die_with_worker``).

The server starts with the worker's first task, not with the worker: a worker that only runs whole jobs never
pays for its imports. Its preload is :mod:`service.workers.task_server_preload`.
"""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

__all__ = ["PRELOAD", "start_task_server", "task_context"]

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
