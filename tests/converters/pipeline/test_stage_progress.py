"""The stages a conversion with a precision plan runs, as its sink sees them (issue 35, item 4): the quality pass and
the plan's search are stages of their own after export, each timed in the report, and the manifest written after
them still checks out (each stage checksums the files it wrote)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from converters.artifact.files import verify_manifest
from converters.model.sources import ModelSourceOptions
from converters.pipeline.progress import progress_event
from converters.pipeline.state import NullSink


class Recorder(NullSink):
    """Every stage and progress event, as the API's events carry them."""

    def __init__(self) -> None:
        super().__init__()
        self.stages: list[str] = []
        self.events: list[dict[str, Any]] = []

    def stage(self, name: str) -> None:
        self.stages.append(name)

    def progress(self, done: int, total: int, unit: str = "step", **detail: Any) -> None:
        self.events.append(progress_event(self.stages[-1], done, total, unit, **detail))


def test_a_plan_job_runs_quality_then_plan_as_stages_of_their_own(tmp_path: Path) -> None:
    from converters.pipeline.driver import ConversionRequest, run_conversion
    from converters.pipeline.request import CalibrationSettings

    request = ConversionRequest(model="demo/tiny-llama", calibration=CalibrationSettings(steps=2, seq_len=32),
                                plan={"min_sqnr_db": 20, "gpu": "h100"})
    sink = Recorder()
    result = run_conversion(request, tmp_path / "out", ModelSourceOptions(demo_dir=tmp_path / "demo"), sink)

    order = ["resolve", "analyze", "calibrate", "convert", "export", "quality", "plan"]
    assert sink.stages == order
    report = json.loads(result.report_path.read_text())
    assert list(report["stage_seconds"]) == order and report["stage_seconds"]["plan"] > 0
    assert report["stage_seconds"]["quality"] > 0 and report["quality"]["measured"] and report["plan"]["made"]
    assert [event["text"] for event in sink.events if event["stage"] == "plan"] == [
        "plan: 0/1 step, now searching the plan and writing its checkpoints", "plan: 1/1 step"]
    quality = [event for event in sink.events if event["stage"] == "quality"]
    assert {event["unit"] for event in quality} == {"layer"} and quality[-1]["done"] == quality[-1]["total"]
    # the plan's files and the export's, checksummed in their stages, are listed as they are on disk
    listed = {entry["name"] for entry in verify_manifest(result.out_dir)}
    assert set(report["plan"]["files"]) <= listed and set(report["files"]) <= listed
