"""A job's events while long work runs (issue 35, item 4), from a real `fp8forge serve` with one worker.

A calibrated job's events name the steps of resolve, count calibration and the quality pass in layers, and show the
quality pass after export as a stage of its own, timed in the report and in the metrics. A requantize job's events
count the shards written and their bytes. Every progress event carries its ``text``, worded by the one formatter the
CLI prints with (:func:`converters.pipeline.progress.progress_text`).
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from converters.analysis.render import human_bytes
from converters.pipeline.progress import progress_text
from tests.service_helpers import ServeProcess, sse_events

pytestmark = pytest.mark.slow


def _submit(client: httpx.Client, body: dict) -> str:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text
    return response.json()["id"]


def _at(data: dict) -> float:
    return datetime.fromisoformat(data["at"]).timestamp()


def test_events_show_resolve_steps_layers_quality_and_shard_bytes(tmp_path: Path, llama_root: Path,
                                                                  sharded_llama: Path) -> None:
    env = {"FP8FORGE_ALLOWED_MODEL_ROOTS": os.pathsep.join([str(llama_root), str(sharded_llama.parent)]),
           "FP8FORGE_HEARTBEAT_INTERVAL_S": "0.5", "FP8FORGE_POLL_INTERVAL_S": "0.2",
           "FP8FORGE_CONVERSION_THREADS": "1"}
    with ServeProcess(tmp_path / "data", workers=1, env=env) as serve, serve.client() as client:
        job_id = _submit(client, {"model": str(llama_root / "llama"), "recipe": {"backend": "ao"},
                                  "calibration": {"steps": 1, "batch_size": 1, "seq_len": 16}})
        events = sse_events(client, f"/v1/jobs/{job_id}/events", timeout=300)
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded", (job, serve.tail())

        stages = [data for kind, data in events if kind == "stage"]
        assert [data["stage"] for data in stages] == ["resolve", "analyze", "calibrate", "convert", "export",
                                                      "quality"]
        assert _at(events[-1][1]) > _at(stages[-1])  # the quality pass takes time of its own, after export
        # and its last step is the job's last progress: the terminal status follows it with nothing in between
        assert [kind for kind, _ in events[-2:]] == ["progress", "status"], events[-3:]
        assert events[-2][1]["stage"] == "quality" and events[-1][1]["status"] == "succeeded", events[-3:]
        report = client.get(job["links"]["report"]).json()
        assert report["stage_seconds"]["quality"] > 0 and report["quality"]["measured"]
        assert 'fp8forge_stage_duration_seconds_count{stage="quality"} 1' in client.get("/metrics").text

        progress = [data for kind, data in events if kind == "progress"]
        assert all(data["text"] == progress_text(data) for data in progress), progress
        # resolve from the conversion process's start: its imports, then each step of the stage
        steps = [data["step"] for data in progress if data["stage"] == "resolve" and data.get("step")]
        assert steps == ["starting the conversion process (imports torch)", "finding the model files",
                         "reading config.json (imports the model's transformers code)",
                         "building the model on the meta device", "indexing the weight files"], progress
        # the resolve stage is announced before the conversion process's imports, not after them
        order = [(kind, data.get("status") or data.get("step") or data.get("stage")) for kind, data in events]
        running = order.index(("status", "running"))
        assert order[running:running + 3] == [("status", "running"), ("stage", "resolve"), (
            "progress", "starting the conversion process (imports torch)")], events[:running + 3]
        calibrate = [data for data in progress if data["stage"] == "calibrate"]
        assert calibrate and {data["unit"] for data in calibrate} == {"layer"}, calibrate
        assert calibrate[-1]["done"] == calibrate[-1]["total"] == 2  # two decoder layers (lm_head is left out)
        quality = [data for data in progress if data["stage"] == "quality"]
        assert quality and quality[-1]["unit"] == "layer" and quality[-1]["done"] == quality[-1]["total"]

        job_id = _submit(client, {"model": str(sharded_llama), "requantize": {"to": "compressed-tensors-fp8-dynamic"}})
        events = sse_events(client, f"/v1/jobs/{job_id}/events", timeout=300)
        job = client.get(f"/v1/jobs/{job_id}").json()
        assert job["status"] == "succeeded", (job, serve.tail())
        index = next(entry for entry in client.get(job["links"]["artifacts"]).json()["data"]
                     if entry["name"] == "model.safetensors.index.json")
        total = client.get(index["url"]).json()["metadata"]["total_size"]
        shards = len(list(sharded_llama.glob("*.safetensors")))
        progress = [data for kind, data in events if kind == "progress"]
        assert all(data["text"] == progress_text(data) for data in progress), progress
        written = [(data["shards_done"], data["bytes_done"], data["bytes_total"]) for data in progress
                   if data["stage"] == "convert"]
        assert [count for count, _, _ in written] == list(range(shards + 1)), written  # from the plan's end on
        assert [data["text"] for data in progress if data["stage"] != "convert"] == [
            f"analyze: 1/1 task, 0/{shards} shards, 0 B of {human_bytes(total)} written",
            f"export: 0/1 task, {shards}/{shards} shards, {human_bytes(total)} of {human_bytes(total)} written",
        ]  # what `fp8forge requantize` prints, as the CLI test shows
        assert {size for _, _, size in written} == {total} and written[-1][1] == total
        sizes = [done for _, done, _ in written]
        assert sizes == sorted(set(sizes)), written  # each shard adds its bytes
