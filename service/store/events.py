"""Job event logs: the append-only record behind ``GET /v1/jobs/{id}/events``.

Events never change a job's status; a status change writes its event inside its own transaction
(``append``), so the two commit, or not, together.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from service.jobs import JobEvent
from service.store.schema import ACTIVE_STATUSES, Tables

__all__ = ["EventLog"]


class EventLog:
    """The ``job_events`` table of one store."""

    def __init__(self, engine: Engine, tables: Tables) -> None:
        self._engine, self._jobs, self._events = engine, tables.jobs, tables.events

    def add(
        self, job_id: str, kind: str, data: Mapping[str, Any], *, worker_id: str | None = None,
        attempt: int | None = None,
    ) -> bool:
        """Append to a job's event log; returns whether it was written.

        With ``worker_id`` (and ``attempt``) the event is only written while that worker still owns that
        attempt of the job, so a worker that lost its job cannot write into the next attempt's stream.
        """
        now = time.time()
        with self._engine.begin() as conn:
            if worker_id is None:
                self.append(conn, job_id, kind, data, now)
                return True
            c = self._jobs.c
            owned = sa.select(c.id).where(c.id == job_id, c.worker_id == worker_id, c.status.in_(ACTIVE_STATUSES))
            if attempt is not None:
                owned = owned.where(c.attempt == attempt)
            row = sa.select(sa.literal(job_id), sa.literal(now, sa.Double), sa.literal(kind),
                            sa.literal(dict(data), sa.JSON)).where(owned.exists())
            insert = self._events.insert().from_select(["job_id", "at", "kind", "data"], row) \
                .returning(self._events.c.seq)
            return conn.execute(insert).first() is not None

    def after(self, job_id: str, after_seq: int = 0, limit: int = 500) -> list[JobEvent]:
        """A job's events with a sequence number above ``after_seq``, oldest first."""
        query = (
            sa.select(self._events).where(self._events.c.job_id == job_id, self._events.c.seq > after_seq)
            .order_by(self._events.c.seq).limit(limit)
        )
        with self._engine.connect() as conn:
            rows = conn.execute(query).mappings().all()
        return [JobEvent(seq=r["seq"], job_id=r["job_id"], at=r["at"], kind=r["kind"], data=r["data"]) for r in rows]

    def append(self, conn: sa.Connection, job_id: str, kind: str, data: Mapping[str, Any], at: float) -> None:
        """Append an event inside the caller's transaction (so it commits, or not, with the change it records)."""
        conn.execute(self._events.insert().values(job_id=job_id, at=at, kind=kind, data=dict(data)))

    def delete(self, conn: sa.Connection, job_id: str) -> None:
        conn.execute(sa.delete(self._events).where(self._events.c.job_id == job_id))
