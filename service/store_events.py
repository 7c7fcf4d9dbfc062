"""The job store's append-only side: job event logs, worker liveness rows and stage timings.

A mixin of ``JobStore`` (``service.store``), kept apart from job queries and transitions because these rows
never change a job's status; they only record what happened and who is alive.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from service.jobs import JobEvent
from service.store_schema import ACTIVE_STATUSES

__all__ = ["EventsAndWorkers"]


class EventsAndWorkers:
    """Event log, worker heartbeat and stage-timing methods of ``JobStore``, which sets the attributes below."""

    engine: Engine
    jobs: sa.Table
    events: sa.Table
    workers: sa.Table
    durations: sa.Table
    _db_now: sa.ColumnElement[float]

    # -- events ------------------------------------------------------------------------------------
    def add_event(
        self, job_id: str, kind: str, data: Mapping[str, Any], *, worker_id: str | None = None,
        attempt: int | None = None,
    ) -> bool:
        """Append to a job's event log; returns whether it was written.

        With ``worker_id`` (and ``attempt``) the event is only written while that worker still owns that
        attempt of the job, so a worker that lost its job cannot write into the next attempt's stream.
        """
        now = time.time()
        with self.engine.begin() as conn:
            if worker_id is None:
                self._event(conn, job_id, kind, data, now)
                return True
            c = self.jobs.c
            owned = sa.select(c.id).where(c.id == job_id, c.worker_id == worker_id, c.status.in_(ACTIVE_STATUSES))
            if attempt is not None:
                owned = owned.where(c.attempt == attempt)
            row = sa.select(sa.literal(job_id), sa.literal(now, sa.Double), sa.literal(kind),
                            sa.literal(dict(data), sa.JSON)).where(owned.exists())
            insert = self.events.insert().from_select(["job_id", "at", "kind", "data"], row) \
                .returning(self.events.c.seq)
            return conn.execute(insert).first() is not None

    def events_after(self, job_id: str, after_seq: int = 0, limit: int = 500) -> list[JobEvent]:
        query = (
            sa.select(self.events).where(self.events.c.job_id == job_id, self.events.c.seq > after_seq)
            .order_by(self.events.c.seq).limit(limit)
        )
        with self.engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [JobEvent(seq=r["seq"], job_id=r["job_id"], at=r["at"], kind=r["kind"], data=r["data"]) for r in rows]

    # -- workers and timings -----------------------------------------------------------------------
    @staticmethod
    def new_worker_id() -> str:
        return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"

    def heartbeat_worker(self, worker_id: str, job_id: str | None = None) -> None:
        """Insert or refresh this worker's row (used by /readyz and /metrics); heartbeats use the database clock."""
        with self.engine.begin() as conn:
            updated = conn.execute(sa.update(self.workers).where(self.workers.c.id == worker_id)
                                   .values(heartbeat_at=self._db_now, job_id=job_id)).rowcount
            if not updated:
                conn.execute(self.workers.insert().values(
                    id=worker_id, hostname=socket.gethostname(), pid=os.getpid(), started_at=time.time(),
                    heartbeat_at=self._db_now, job_id=job_id))

    def remove_worker(self, worker_id: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(sa.delete(self.workers).where(self.workers.c.id == worker_id))

    def live_workers(self, timeout_s: float) -> list[dict[str, Any]]:
        """Workers that heartbeated within ``timeout_s``; also forgets long-silent ones."""
        with self.engine.begin() as conn:
            conn.execute(sa.delete(self.workers).where(self.workers.c.heartbeat_at < self._db_now - 10 * timeout_s))
            rows = conn.execute(sa.select(self.workers).where(
                self.workers.c.heartbeat_at >= self._db_now - timeout_s)).mappings().all()
        return [dict(r) for r in rows]

    def record_stage_durations(self, job_id: str, durations: Iterable[tuple[str, float]]) -> None:
        rows = [{"job_id": job_id, "stage": stage, "seconds": seconds} for stage, seconds in durations]
        if rows:
            with self.engine.begin() as conn:
                conn.execute(self.durations.insert(), rows)

    def stage_duration_stats(self) -> dict[str, tuple[int, float]]:
        """Per stage: (number of recorded runs, total seconds)."""
        query = sa.select(self.durations.c.stage, sa.func.count(), sa.func.sum(self.durations.c.seconds)) \
            .group_by(self.durations.c.stage)
        with self.engine.connect() as conn:
            return {stage: (n, float(total or 0.0)) for stage, n, total in conn.execute(query)}

    def _event(self, conn: sa.Connection, job_id: str, kind: str, data: Mapping[str, Any], at: float) -> None:
        """Append an event inside the caller's transaction (so it commits, or not, with the change it records)."""
        conn.execute(self.events.insert().values(job_id=job_id, at=at, kind=kind, data=dict(data)))
