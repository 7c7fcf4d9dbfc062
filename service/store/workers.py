"""Worker liveness rows (for ``/readyz`` and ``/metrics``) and the stage timings behind ETAs.

Heartbeats use the database clock, so hosts whose clocks disagree still agree on who is alive.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from service.store.schema import Tables

__all__ = ["StageTimings", "WorkerRegistry"]


class WorkerRegistry:
    """The ``workers`` table of one store."""

    def __init__(self, engine: Engine, tables: Tables, db_now: sa.ColumnElement[float]) -> None:
        self._engine, self._workers, self._db_now = engine, tables.workers, db_now

    @staticmethod
    def new_id() -> str:
        """Host, PID and a random tail: unique across hosts and restarts, readable in operators' logs."""
        return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"

    def heartbeat(self, worker_id: str, job_id: str | None = None, *, host: str | None = None) -> None:
        """Insert or refresh this worker's row; ``host`` is its host's name in the store (``this_host``), by which
        claims tell which live workers could retry what another host failed."""
        values: dict[str, Any] = {"heartbeat_at": self._db_now, "job_id": job_id}
        if host is not None:
            values["host"] = host
        for _ in range(2):
            try:
                with self._engine.begin() as conn:
                    if conn.execute(sa.update(self._workers).where(self._workers.c.id == worker_id)
                                    .values(**values)).rowcount:
                        return
                    conn.execute(self._workers.insert().values(
                        id=worker_id, hostname=socket.gethostname(), pid=os.getpid(), started_at=time.time(),
                        **values))
                    return
            except sa.exc.IntegrityError:  # another thread of this worker inserted the row first: update it
                continue

    def remove(self, worker_id: str) -> None:
        with self._engine.begin() as conn:
            conn.execute(sa.delete(self._workers).where(self._workers.c.id == worker_id))

    def live(self, timeout_s: float) -> list[dict[str, Any]]:
        """Workers that heartbeated within ``timeout_s``; also forgets long-silent ones."""
        w = self._workers
        with self._engine.begin() as conn:
            conn.execute(sa.delete(w).where(w.c.heartbeat_at < self._db_now - 10 * timeout_s))
            rows = conn.execute(sa.select(w).where(w.c.heartbeat_at >= self._db_now - timeout_s)).mappings().all()
        return [dict(r) for r in rows]


class StageTimings:
    """The ``stage_durations`` table: how long each stage of finished attempts took."""

    def __init__(self, engine: Engine, tables: Tables) -> None:
        self._engine, self._durations = engine, tables.durations

    def record(self, job_id: str, durations: Iterable[tuple[str, float]]) -> None:
        rows = [{"job_id": job_id, "stage": stage, "seconds": seconds} for stage, seconds in durations]
        if rows:
            with self._engine.begin() as conn:
                conn.execute(self._durations.insert(), rows)

    def stats(self) -> dict[str, tuple[int, float]]:
        """Per stage: (number of recorded runs, total seconds)."""
        d = self._durations
        query = sa.select(d.c.stage, sa.func.count(), sa.func.sum(d.c.seconds)).group_by(d.c.stage)
        with self._engine.connect() as conn:
            return {stage: (n, float(total or 0.0)) for stage, n, total in conn.execute(query)}
