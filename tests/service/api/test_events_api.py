"""The job event log as server-sent events over real HTTP."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from service.config import Settings
from service.jobs import JobStatus, Stage
from service.store import JobStore
from tests.service_helpers import live_app, sse_events


def test_events_follow_a_job_live_and_end_when_it_ends(tmp_path: Path) -> None:
    settings = Settings(data_dir=tmp_path / "data", workers=0, auth_disabled=True)
    with live_app(settings) as client:
        store = JobStore(settings.store_url)
        job, _ = store.create_job({"model": "demo/tiny-llama"}, request_hash="h")

        def work() -> None:  # plays a worker, slowly, while the client follows
            time.sleep(0.3)
            store.claim_next("w")
            store.events.add(job.id, "stage", {"stage": Stage.CALIBRATE.value})
            store.events.add(job.id, "progress", {"stage": "calibrate", "done": 1, "total": 2})
            store.events.add(job.id, "warning", {"message": "few calibration texts"})
            time.sleep(0.6)
            store.set_status(job.id, JobStatus.FAILED, owner="w", error_code="conversion_failed",
                             error_message="boom", event={"error": {"code": "conversion_failed"}})

        worker = threading.Thread(target=work)
        worker.start()
        started = time.monotonic()
        events = sse_events(client, f"/v1/jobs/{job.id}/events", timeout=20)
        worker.join()
        assert time.monotonic() - started < 10
        kinds = [(kind, data.get("status") or data.get("stage") or data.get("message")) for kind, data in events]
        assert kinds == [("status", "queued"), ("status", "running"), ("stage", "calibrate"),
                         ("progress", "calibrate"), ("warning", "few calibration texts"), ("status", "failed")]
        assert all("at" in data for _, data in events)

        all_ids = [e.seq for e in store.events.after(job.id)]
        resumed = sse_events_after(client, job.id, all_ids[2])
        assert [kind for kind, _ in resumed] == ["progress", "warning", "status"]
        store.close()


def sse_events_after(client, job_id: str, last_id: int):
    events = []
    with client.stream("GET", f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(last_id)}) as response:
        kind = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append((kind, line[6:]))
    return events
