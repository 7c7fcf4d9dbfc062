"""The counts behind /metrics, on both databases: the bytes sum and the histograms are dialect-specific SQL."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.api.metrics import render_metrics
from service.config import Settings
from service.jobs import JobStatus
from service.store.outcomes import ConversionOutcomes
from tests.service_helpers import make_store

REQUEST = {"model": {"id": "demo/tiny-llama"}, "recipe": {"backend": "te", "scaling": "delayed"}}


@pytest.mark.parametrize("kind", ["sqlite", "postgresql"])
def test_outcomes_count_finished_jobs_tasks_retries_and_bytes(kind, tmp_path) -> None:
    with make_store(kind, tmp_path) as (store, _url, _prefix):
        ids = [store.create_job(dict(REQUEST, n=i), request_hash=f"h{i}")[0].id for i in range(3)]
        for _ in ids:
            assert store.claim_next("w-test") is not None
        store.set_status(ids[0], JobStatus.SUCCEEDED, artifacts=[{"name": "a", "bytes": 7 * 2**30, "sha256": "0"},
                                                                {"name": "b", "bytes": 5, "sha256": "1"}])
        store.set_status(ids[1], JobStatus.FAILED, error_code="disk_full", error_message="no space")
        store.timings.record(ids[0], [("calibrate", 0.5), ("calibrate", 20.0)])
        outcomes = ConversionOutcomes(store.engine, store.tables)
        assert outcomes.jobs_by_outcome() == {("succeeded", ""): 1, ("failed", "disk_full"): 1}
        assert outcomes.artifact_bytes_published() == 7 * 2**30 + 5
        assert outcomes.retries() == {"job": 0, "task": 0, "host_fault": 0}
        [calibrate] = outcomes.stage_histograms()
        assert (calibrate.stage, calibrate.count, calibrate.total_s) == ("calibrate", 2, 20.5)
        assert calibrate.cumulative[:4] == (1, 1, 1, 2)  # bounds 1, 5, 15, 60 s
        families = {f.name: f for f in text_string_to_metric_families(render_metrics(store, Settings()).decode())}
        running = [s for s in families["fp8forge_jobs"].samples if s.labels == {"status": "running"}]
        assert [s.value for s in running] == [1]
        assert {s.name for s in families["fp8forge_stage_duration_seconds"].samples} >= {
            "fp8forge_stage_duration_seconds_bucket", "fp8forge_stage_duration_seconds_sum"}
