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
environment at the server's start.

What the server imports depends on what the worker forks: :mod:`service.workers.task_server_preload` (torch,
transformers, torchao and the pipeline) for conversions, :mod:`service.workers.shard_task_preload` (torch and the
task functions: a fraction of the seconds and memory; docs/service.md) while a worker has forked shard tasks only. A
conversion that follows such a server replaces it (a worker runs one child at a time, so the server has no child
then); a server with the conversion imports also forks tasks. The API process forks its analysis children
(``service.api.analyze_pool``) from a server of its own the same way, from threads: the server is chosen under a
lock.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from multiprocessing import forkserver
from multiprocessing.context import BaseContext

__all__ = ["PRELOAD", "SHARD_TASK_PRELOAD", "adopt_worker_environment", "start_task_server", "task_context",
           "worker_environment"]

#: What a fork server that forks conversions imports before its first child.
PRELOAD = "service.workers.task_server_preload"
#: What a fork server that has forked shard tasks only imports.
SHARD_TASK_PRELOAD = "service.workers.shard_task_preload"

#: the fork server this process started last: its pid -> the preload it imported
_preloaded: dict[int, str] = {}
_choosing = threading.Lock()


def task_context(*, conversions: bool) -> BaseContext:
    """The multiprocessing context children start from: this worker's fork server, running once this returns.

    ``conversions``: the child is a conversion, whose server must have imported :data:`PRELOAD`; otherwise a shard
    task, which any of this worker's servers can fork (a new one imports :data:`SHARD_TASK_PRELOAD` only)."""
    context = mp.get_context("forkserver")
    server = forkserver._forkserver
    with _choosing:
        running = _preloaded.get(server._forkserver_pid)  # None: no server, or not one this process started
        if conversions and running == SHARD_TASK_PRELOAD:
            server._stop()  # no child of it lives (one at a time per worker): it exits once its pipe is closed
            running = None
        wanted = PRELOAD if conversions or running == PRELOAD else SHARD_TASK_PRELOAD
        context.set_forkserver_preload([wanted])  # read where ensure_running starts a server (none, or a dead one)
        before = server._forkserver_pid
        forkserver.ensure_running()
        if server._forkserver_pid != before:  # a new server: it imported what was wanted
            _preloaded.clear()
            _preloaded[server._forkserver_pid] = wanted
    return context


def start_task_server(*, conversions: bool) -> None:
    """Start the fork server now (it imports its preload in the background while the worker goes on); the first
    child's :func:`task_context` starts it otherwise."""
    task_context(conversions=conversions)


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
