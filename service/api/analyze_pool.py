"""The processes that run ``/v1/analyze``: building a model from a client's config costs seconds and hundreds of
megabytes (a calibrated analysis loads weights and uses every core it gets), so it never runs in the API process.

A few children each run one analysis at a time; a bounded number of requests wait for one, on the event loop (no
thread is held while they wait); the rest are refused at once with 503 and ``Retry-After``. A child that dies (out
of memory) or runs past the time bound is killed and replaced, and its request gets 503, never a hung connection.
Forty calibrated analyses in parallel used to hold the API's threads and stalled ``/healthz`` for 44 s.

Analysis children are forks of the API process's fork server (``service.workers.task_server``, the one a worker's
conversions fork from): torch, transformers and the converters are imported once per API process, not once per
child, so a replacement starts in a fraction of a second and the children share the server's pages. The children
that check model files import none of that and are spawned.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from anyio import to_thread

from converters.errors import Fp8ForgeError
from service.errors import AnalysisAborted, AnalyzeBusy
from service.workers.procs import die_with_worker
from service.workers.task_server import task_context

__all__ = ["AnalysisPool", "as_json", "model_checks"]

logger = logging.getLogger(__name__)

#: How long a new child may take to start (import torch and transformers) before its request gets 503.
STARTUP_S = 120.0
#: What a refused client is told to wait: an analysis on the meta device takes about a second.
RETRY_AFTER_S = 5


class AnalysisPool:
    """Runs ``fn(*args)`` in one of ``workers`` children, ``queue_depth`` requests waiting at most.

    Use it from the event loop only (``await pool.run(...)``); children start on first use, forked from the fork
    server. With ``preload`` False a child is spawned and imports nothing ahead (no torch): a pool of such children
    runs the checks of a job's model files (:func:`model_checks`), which must not wait seconds for a server's start.
    """

    def __init__(self, *, workers: int, queue_depth: int, timeout_s: float, threads: int | None = None,
                 preload: bool = True, busy: str | None = None, late: str | None = None) -> None:
        self._workers = workers
        self._preload = preload
        self._busy, self._late = busy, late  # what a refused or stopped request is told, when not an analysis
        self._capacity = workers + queue_depth
        self._timeout_s = timeout_s
        self._threads = threads
        self._pending = 0
        self._idle: list[_Child] = []
        self._free: asyncio.Semaphore | None = None
        self._closed = False

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` in a child (``fn`` a module-level function; its result and exceptions are pickled).

        Raises:
            AnalyzeBusy: every child is busy and ``queue_depth`` requests already wait (503, Retry-After).
            AnalysisAborted: the child died or ran past ``timeout_s``; it was replaced (503).
            whatever ``fn`` raised.
        """
        if self._closed or self._pending >= self._capacity:
            raise AnalyzeBusy(self._busy or (
                f"all {self._workers} analysis processes are busy and {self._capacity - self._workers} requests "
                "wait already; retry after a few seconds (the operator can raise FP8FORGE_ANALYZE_WORKERS or "
                "FP8FORGE_ANALYZE_QUEUE_DEPTH)"), headers={"Retry-After": str(RETRY_AFTER_S)})
        if self._free is None:
            self._free = asyncio.Semaphore(self._workers)
            if not self._preload:  # light children all start with the first request: no later one waits for a start
                self._idle.extend(_Child(self._threads, self._preload) for _ in range(self._workers))
        self._pending += 1
        try:
            async with self._free:
                # a fork server's child starts once the server has imported (seconds, the first time): off the loop
                child = self._idle.pop() if self._idle else await to_thread.run_sync(_Child, self._threads,
                                                                                      self._preload)
                answered = False
                try:
                    status, value = await child.call(fn, args, self._timeout_s, self._late)
                    answered = True
                finally:
                    if answered and not self._closed:
                        self._idle.append(child)
                    else:  # dead, late, or abandoned while it ran (cancelled): never hand a busy child out again
                        child.kill()
        finally:
            self._pending -= 1
        if status == "error":
            raise value
        if status == "crash":
            raise RuntimeError(f"the analysis failed in its process: {value}")
        return value

    def close(self) -> None:
        """Stop every idle child; busy ones are stopped as their requests end."""
        self._closed = True
        while self._idle:
            self._idle.pop().kill()


#: Processes that check the model files of submitted jobs and analyses (config, index, headers): each check reads
#: bounded files in milliseconds to a second, so two keep up with any submission rate the database allows.
CHECK_WORKERS = 2
#: Submissions that may wait for a check process: a waiting one holds no thread, only its request.
CHECK_QUEUE_DEPTH = 256
#: A check reads at most a config, an index and one header, each bounded (``converters.model.limits``).
CHECK_TIMEOUT_S = 60.0


def model_checks() -> AnalysisPool:
    """The pool that runs the checks of a local model's files (``include_check.check_local_model``) for the API:
    those reads are bounded, but a bounded read of a client's file still costs up to a second and a hundred
    megabytes, which the API's own threads and memory must not pay."""
    return AnalysisPool(
        workers=CHECK_WORKERS, queue_depth=CHECK_QUEUE_DEPTH, timeout_s=CHECK_TIMEOUT_S, threads=1, preload=False,
        busy=f"the server is checking the model files of {CHECK_QUEUE_DEPTH} other requests; retry after a few seconds",
        late=f"checking the model's files took more than {CHECK_TIMEOUT_S:g} s and was stopped; make sure its "
             "config.json, index and safetensors headers are the ones saved with the model, then retry")


def as_json(fn: Callable[..., Any], *args: Any) -> bytes:
    """``fn(*args)`` as the JSON body the API sends (Starlette's JSONResponse encoding), made in the child: a large
    report encoded on the API's event loop would hold every other request for as long."""
    return json.dumps(fn(*args), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


class _Child:
    """One process and the pipe to it; it reports ``ready`` once its imports are done. With ``preload`` a fork of
    the fork server (whose start may take seconds: construct it off the event loop), else spawned.

    Raises:
        AnalysisAborted: the fork server could not start the process (it died while importing).
    """

    def __init__(self, threads: int | None, preload: bool) -> None:
        context = task_context(conversions=True) if preload else multiprocessing.get_context("spawn")
        self.conn, theirs = context.Pipe()
        self.process = context.Process(target=_child_main, args=(theirs, os.getpid(), threads, preload),
                                       name="fp8forge-analyze", daemon=True)
        try:
            self.process.start()
        except (EOFError, OSError) as exc:  # the server ended before it forked
            self.conn.close()
            raise AnalysisAborted(f"the analysis process could not be started ({exc or type(exc).__name__}); retry",
                                  headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        finally:
            theirs.close()
        self.ready = False

    async def call(self, fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, late: str | None = None
                   ) -> tuple[str, Any]:
        """The child's answer to ``fn(*args)``: ``("ok", result)``, ``("error", exception)`` or ``("crash", text)``.

        Raises:
            AnalysisAborted: the child died, or did not start or answer in time.
        """
        if not self.ready:
            await self._receive(STARTUP_S, f"the analysis process did not start within {STARTUP_S:g} s; retry")
            self.ready = True
        await to_thread.run_sync(self.conn.send, (fn, args))
        return await self._receive(
            timeout_s, late or f"the analysis did not finish within {timeout_s:g} s and was stopped; analyze a "
            "model this large with a conversion job or `fp8forge analyze` (the operator can raise "
            "FP8FORGE_ANALYZE_TIMEOUT_S)")

    async def _receive(self, timeout_s: float, late: str) -> Any:
        """The child's next message, waited for on the event loop (no thread is held while the child works);
        AnalysisAborted with ``late`` after ``timeout_s``."""
        loop = asyncio.get_running_loop()
        readable = asyncio.Event()
        loop.add_reader(self.conn.fileno(), readable.set)
        try:
            await asyncio.wait_for(readable.wait(), timeout_s)
        except asyncio.TimeoutError:
            raise AnalysisAborted(late) from None
        finally:
            loop.remove_reader(self.conn.fileno())
        try:
            return await to_thread.run_sync(self.conn.recv)
        except (EOFError, OSError):
            self.process.join(1)
            raise AnalysisAborted(
                f"the analysis process ended (exit code {self.process.exitcode}) before it answered, e.g. out of "
                "memory; retry, or analyze a smaller model", headers={"Retry-After": str(RETRY_AFTER_S)}) from None

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


def _child_main(conn: Connection, parent_pid: int, threads: int | None, preload: bool = True) -> None:
    """Answer ``(fn, args)`` messages with ``("ok", result)``, ``("error", exception)`` or ``("crash", text)``
    until the pipe closes."""
    die_with_worker(parent_pid)  # the API process, this process's parent or its fork server's
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on `fp8forge serve` is the API's to handle
    if preload:  # a checks child imports neither torch nor the workers' modules: it starts in a fraction of a second
        from service.workers.child import limit_threads, thread_budget  # the fork server imported them

        limit_threads(thread_budget(threads))
        # what an analysis runs, loaded before the first request, whose time bound an import would use up (the
        # fork server imported torch, transformers' model code and most of the converters already)
        import converters.pipeline.sync_analysis  # noqa: F401

    conn.send("ready")
    while True:
        try:
            fn, args = conn.recv()
        except (EOFError, OSError):
            return
        answer = _answer(fn, args)
        try:
            conn.send(answer)  # pickled whole before anything is written
        except Exception as exc:  # noqa: BLE001 - a result or exception that cannot cross the pipe
            conn.send(("crash", f"cannot send {type(answer[1]).__name__} back: {exc}"))


def _answer(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[str, Any]:
    try:
        return "ok", fn(*args)
    except Fp8ForgeError as exc:
        return "error", exc
    except Exception as exc:  # noqa: BLE001 - the API answers 500 and logs it as a bug; the child lives on
        logger.exception("analysis failed")
        return "crash", f"{type(exc).__name__}: {exc}"
