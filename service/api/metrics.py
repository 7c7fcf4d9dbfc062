"""``/metrics`` through prometheus_client: the store's jobs, workers, stages, tasks, retries and bytes published.

The figures live in the database (service.store.outcomes), so a collector reads them at scrape time into a fresh
registry: every API process answers the same, and none keeps counters that a restart would lose.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from service.config import Settings
from service.jobs import STAGES
from service.store import JobStore
from service.store.outcomes import STAGE_SECONDS_BUCKETS, ConversionOutcomes

__all__ = ["CONTENT_TYPE", "render_metrics"]

CONTENT_TYPE = CONTENT_TYPE_LATEST


class StoreCollector(Collector):
    """Reads one store at each scrape."""

    def __init__(self, store: JobStore, settings: Settings) -> None:
        self._store = store
        self._settings = settings
        self._outcomes = ConversionOutcomes(store.engine, store.tables)

    def collect(self) -> Iterator[Metric]:
        yield from self._jobs()
        yield from self._workers()
        yield self._stage_seconds()
        yield from self._work_done()

    def _jobs(self) -> Iterator[Metric]:
        by_status = GaugeMetricFamily("fp8forge_jobs", "Jobs in the store by status.", labels=["status"])
        for status, count in self._store.count_by_status().items():
            by_status.add_metric([status.value], count)
        yield by_status
        outcomes = CounterMetricFamily("fp8forge_jobs_finished", "Finished jobs by outcome and error code.",
                                       labels=["status", "error_code"])
        for (status, code), count in sorted(self._outcomes.jobs_by_outcome().items()):
            outcomes.add_metric([status, code], count)
        yield outcomes

    def _workers(self) -> Iterator[Metric]:
        workers = self._store.workers.live(self._settings.heartbeat_timeout_s)
        yield GaugeMetricFamily("fp8forge_workers", "Workers with a fresh heartbeat.", value=len(workers))
        yield GaugeMetricFamily("fp8forge_workers_busy", "Workers running a job.",
                                value=sum(1 for w in workers if w["job_id"]))

    def _stage_seconds(self) -> Metric:
        histogram = HistogramMetricFamily("fp8forge_stage_duration_seconds", "Time spent in each pipeline stage.",
                                          labels=["stage"])
        recorded = {h.stage: h for h in self._outcomes.stage_histograms()}
        bounds = [repr(float(b)) for b in STAGE_SECONDS_BUCKETS]
        for stage in dict.fromkeys([s.value for s in STAGES] + sorted(recorded)):
            h = recorded.get(stage)
            cumulative = h.cumulative if h else (0,) * len(bounds)
            count = h.count if h else 0
            buckets = [*zip(bounds, cumulative, strict=True), ("+Inf", count)]
            histogram.add_metric([stage], buckets, sum_value=h.total_s if h else 0.0)
        return histogram

    def _work_done(self) -> Iterator[Metric]:
        tasks = GaugeMetricFamily("fp8forge_tasks", "Tasks of split jobs (requantize shards, serving writes) by kind "
                                  "and status.", labels=["kind", "status"])
        for (kind, status), count in sorted(self._outcomes.tasks_by_kind_and_status().items()):
            tasks.add_metric([kind, status], count)
        yield tasks
        retries = CounterMetricFamily("fp8forge_retries", "Attempts beyond the first (job, task) and the retries "
                                      "moved off a faulty host (host_fault).", labels=["of"])
        for of, count in self._outcomes.retries().items():
            retries.add_metric([of], count)
        yield retries
        yield CounterMetricFamily("fp8forge_artifact_bytes", "Bytes of the artifacts of succeeded jobs.",
                                  value=self._outcomes.artifact_bytes_published())


def render_metrics(store: JobStore, settings: Settings) -> bytes:
    """The exposition text of one scrape."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store, settings))
    return generate_latest(registry)
