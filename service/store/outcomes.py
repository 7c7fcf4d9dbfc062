"""What the store knows about the conversions it has run, read for ``/metrics``.

Every figure is counted from the tables themselves (jobs, job_tasks, stage_durations), so every API process reports
the same numbers and a restart loses none of them: no process keeps a counter of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from service.jobs import JobStatus
from service.store.schema import Tables

__all__ = ["STAGE_SECONDS_BUCKETS", "ConversionOutcomes", "StageHistogram"]

#: Upper bounds (seconds) of the stage-duration histogram: a small job's stages take seconds, a large model's hours.
STAGE_SECONDS_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0)


@dataclass(frozen=True)
class StageHistogram:
    """One stage's recorded durations: cumulative counts per bucket bound, then the count and the sum."""

    stage: str
    cumulative: tuple[int, ...]
    count: int
    total_s: float


class ConversionOutcomes:
    """Counts over the finished jobs and their tasks of one store."""

    def __init__(self, engine: Engine, tables: Tables) -> None:
        self._engine = engine
        self._t = tables

    def jobs_by_outcome(self) -> dict[tuple[str, str], int]:
        """Finished jobs by (status, error code); a succeeded or cancelled job has the code ``""``."""
        jobs = self._t.jobs
        finished = (JobStatus.SUCCEEDED.value, JobStatus.FAILED.value, JobStatus.CANCELLED.value)
        query = (sa.select(jobs.c.status, jobs.c.error_code, sa.func.count()).where(jobs.c.status.in_(finished))
                 .group_by(jobs.c.status, jobs.c.error_code))
        with self._engine.connect() as conn:
            return {(status, code or ""): n for status, code, n in conn.execute(query)}

    def tasks_by_kind_and_status(self) -> dict[tuple[str, str], int]:
        tasks = self._t.tasks
        query = sa.select(tasks.c.kind, tasks.c.status, sa.func.count()).group_by(tasks.c.kind, tasks.c.status)
        with self._engine.connect() as conn:
            return {(kind, status): n for kind, status, n in conn.execute(query)}

    def retries(self) -> dict[str, int]:
        """Attempts beyond the first, of jobs and of tasks, plus the retries that moved work off a faulty host."""
        jobs, tasks = self._t.jobs, self._t.tasks
        beyond_first = lambda column: sa.func.coalesce(sa.func.sum(sa.case((column > 1, column - 1), else_=0)), 0)  # noqa: E731
        with self._engine.connect() as conn:
            job_retries = conn.execute(sa.select(beyond_first(jobs.c.attempt))).scalar_one()
            task_retries = conn.execute(sa.select(beyond_first(tasks.c.attempt))).scalar_one()
            host_moves = conn.execute(sa.select(sa.func.coalesce(sa.func.sum(jobs.c.host_faults), 0))).scalar_one()
            host_moves += conn.execute(sa.select(sa.func.coalesce(sa.func.sum(tasks.c.host_faults), 0))).scalar_one()
        return {"job": int(job_retries), "task": int(task_retries), "host_fault": int(host_moves)}

    def artifact_bytes_published(self) -> int:
        """The bytes of every succeeded job's artifacts (its listing's ``bytes``), summed by the database."""
        jobs = self._t.jobs.name
        if self._engine.dialect.name == "sqlite":
            sql = (f"SELECT coalesce(sum(json_extract(a.value, '$.bytes')), 0) FROM \"{jobs}\" AS j, "
                   f"json_each(j.artifacts) AS a WHERE j.status = :done AND j.artifacts IS NOT NULL")
        else:
            sql = (f"SELECT coalesce(sum((a ->> 'bytes')::bigint), 0) FROM \"{jobs}\" AS j, "
                   f"jsonb_array_elements(CAST(j.artifacts AS jsonb)) AS a WHERE j.status = :done "
                   f"AND j.artifacts IS NOT NULL AND jsonb_typeof(CAST(j.artifacts AS jsonb)) = 'array'")
        with self._engine.connect() as conn:
            return int(conn.execute(sa.text(sql), {"done": JobStatus.SUCCEEDED.value}).scalar_one())

    def stage_histograms(self, buckets: Sequence[float] = STAGE_SECONDS_BUCKETS) -> list[StageHistogram]:
        """Per recorded stage, its durations counted into ``buckets`` by one grouped query."""
        d = self._t.durations
        columns = [sa.func.sum(sa.case((d.c.seconds <= bound, 1), else_=0)) for bound in buckets]
        query = sa.select(d.c.stage, sa.func.count(), sa.func.sum(d.c.seconds), *columns).group_by(d.c.stage)
        with self._engine.connect() as conn:
            return [StageHistogram(stage, tuple(int(c or 0) for c in counts), int(n), float(total or 0.0))
                    for stage, n, total, *counts in conn.execute(query)]
