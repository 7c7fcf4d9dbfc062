"""Prometheus text exposition of the store: jobs by status, stage durations, live workers."""

from __future__ import annotations

from service.config import Settings
from service.jobs import STAGES
from service.store import JobStore

__all__ = ["render_metrics", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(store: JobStore, settings: Settings) -> str:
    """Read the store and render the metrics (every process sees the same numbers: they live in the DB)."""
    lines = ["# HELP fp8forge_jobs Jobs in the store by status.", "# TYPE fp8forge_jobs gauge"]
    for status, count in store.count_by_status().items():
        lines.append(f'fp8forge_jobs{{status="{status.value}"}} {count}')
    stats = store.timings.stats()
    lines += ["# HELP fp8forge_stage_duration_seconds Time spent in each pipeline stage.",
              "# TYPE fp8forge_stage_duration_seconds summary"]
    for stage in STAGES:
        count, total = stats.get(stage.value, (0, 0.0))
        lines.append(f'fp8forge_stage_duration_seconds_sum{{stage="{stage.value}"}} {total:.6f}')
        lines.append(f'fp8forge_stage_duration_seconds_count{{stage="{stage.value}"}} {count}')
    workers = store.workers.live(settings.heartbeat_timeout_s)
    lines += ["# HELP fp8forge_workers Workers with a fresh heartbeat.", "# TYPE fp8forge_workers gauge",
              f"fp8forge_workers {len(workers)}",
              "# HELP fp8forge_workers_busy Workers running a job.", "# TYPE fp8forge_workers_busy gauge",
              f"fp8forge_workers_busy {sum(1 for w in workers if w['job_id'])}"]
    return "\n".join(lines) + "\n"
