"""A check that gives up after a bound time, run in a thread of its own, one at a time.

``/readyz`` must answer even when the store does not: a database server that stopped answering leaves a query
waiting on its socket for minutes, and a lock held by a stopped process leaves it waiting for the lock timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Generic, TypeVar

__all__ = ["Probe"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Probe(Generic[T]):
    """Runs checks in a daemon thread and waits a bound time for each.

    While a check is still running (hung) a new call waits for that one instead of starting another, so a store
    that hangs for an hour costs one thread, not one per probe.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._running: Future[T] | None = None

    def run(self, check: Callable[[], T], within_s: float) -> T | None:
        """``check()``'s result, or None when it raised or did not return within ``within_s`` seconds."""
        with self._lock:
            if self._running is None or self._running.done():
                self._running = self._start(check)
            running = self._running
        try:
            return running.result(timeout=within_s)
        except FutureTimeout:
            logger.warning("%s: no answer within %gs", self._name, within_s)
        except Exception as exc:  # noqa: BLE001 - any failure means "no answer"
            logger.warning("%s failed: %s", self._name, (str(exc).strip().splitlines() or [type(exc).__name__])[0])
        return None

    def _start(self, check: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()

        def target() -> None:
            try:
                future.set_result(check())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)

        threading.Thread(target=target, name=self._name, daemon=True).start()
        return future
