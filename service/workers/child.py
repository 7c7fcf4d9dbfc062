"""The spawned process that runs one conversion and reports back to its worker over a pipe.

This is the one place where ``service`` meets ``converters`` (and thus torch): the worker process itself
stays free of CUDA state, so killing this child is always a safe way to stop a run.

The messages it sends are the typed ones of ``service.workers.messages``.
"""

from __future__ import annotations

import logging
import signal
import traceback
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

from service.workers.messages import Failed, Progress, StageStarted, Succeeded, Warned
from service.workers.procs import die_with_parent

__all__ = ["PipeSink", "child_main"]

logger = logging.getLogger(__name__)


class PipeSink:
    """``converters.pipeline.ProgressSink`` that forwards everything to the worker."""

    def __init__(self, conn: Connection, stop: Event) -> None:
        self._conn = conn
        self._stop = stop

    def stage(self, name: str) -> None:
        self._conn.send(StageStarted(str(name)))

    def progress(self, done: int, total: int) -> None:
        self._conn.send(Progress(int(done), int(total)))

    def warning(self, message: str) -> None:
        self._conn.send(Warned(str(message)))

    def should_stop(self) -> bool:
        return self._stop.is_set()


def child_main(
    request: dict[str, Any], out_dir: str, sources: dict[str, Any], conn: Connection, stop: Event,
    parent_pid: int,
) -> None:
    """Run ``converters.pipeline.run_conversion`` for one job; never raises."""
    die_with_parent(parent_pid)
    # Ctrl-C reaches the whole process group; the worker decides how this run stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s [conversion] %(name)s: %(message)s")
    try:
        from converters.errors import Fp8ForgeError
        from converters.model_sources import ModelSourceOptions
        from converters.pipeline import ConversionRequest, run_conversion

        try:
            result = run_conversion(
                ConversionRequest.from_dict(request), Path(out_dir), ModelSourceOptions(**sources),
                PipeSink(conn, stop),
            )
            conn.send(Succeeded([dict(m) for m in result.manifest]))
        except Fp8ForgeError as exc:
            conn.send(Failed(exc.code, exc.message))
    except BaseException as exc:  # noqa: BLE001 - the worker must learn why, whatever happened
        logger.error("conversion crashed:\n%s", traceback.format_exc())
        conn.send(Failed("internal_error", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()
