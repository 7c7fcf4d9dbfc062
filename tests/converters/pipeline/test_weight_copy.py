"""The weight files are copied while calibration runs; a failed or cancelled job stops the copy and leaves nothing."""

from __future__ import annotations

import hashlib
import json
import threading
import time

import pytest

import converters.artifact.files as artifact_files
from converters.errors import ConversionCancelled
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.pipeline.state import NullSink

REQUEST = {"recipe": {"backend": "ao"}, "calibration": CalibrationSettings(steps=2, seq_len=32)}


class StageClock(NullSink):
    """Records when each stage began; asks to stop once ``stop_at`` has begun."""

    def __init__(self, stop_at: str | None = None) -> None:
        super().__init__()
        self.began: dict[str, float] = {}
        self.stop_at = stop_at

    def stage(self, name: str) -> None:
        self.began[name] = time.perf_counter()

    def should_stop(self) -> bool:
        return self.stop_at is not None and self.stop_at in self.began


def _copy_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "fp8forge-weight-copy"]


def test_the_copy_starts_before_calibration_and_the_artifact_holds_the_source_bytes(llama_dir, tmp_path, monkeypatch):
    started: list[float] = []
    original = artifact_files.copy_model_file

    def timed(source, destination, confinement):
        started.append(time.perf_counter())
        return original(source, destination, confinement)

    monkeypatch.setattr(artifact_files, "copy_model_file", timed)
    sink = StageClock()
    out = tmp_path / "out"
    run_conversion(ConversionRequest(model=str(llama_dir), **REQUEST), out,
                   ModelSourceOptions(allowed_roots=(llama_dir.parent,)), sink)
    assert started and started[0] < sink.began["convert"]  # under way before calibration was over
    assert (out / "model.safetensors").read_bytes() == (llama_dir / "model.safetensors").read_bytes()
    assert not _copy_threads()
    # the copy thread's checksum is the manifest's, and it is the source file's own
    manifest = {entry["name"]: entry["sha256"] for entry in json.loads((out / "manifest.json").read_text())["files"]}
    assert manifest["model.safetensors"] == hashlib.sha256((llama_dir / "model.safetensors").read_bytes()).hexdigest()


def test_a_cancelled_job_stops_the_copy_and_leaves_nothing(llama_dir, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(ConversionCancelled):
        run_conversion(ConversionRequest(model=str(llama_dir), **REQUEST), out,
                       ModelSourceOptions(allowed_roots=(llama_dir.parent,)), StageClock(stop_at="calibrate"))
    assert not list(tmp_path.iterdir()) and not _copy_threads()


def test_a_failed_copy_fails_the_job_at_export_and_leaves_nothing(llama_dir, tmp_path, monkeypatch):
    def broken(source, destination, confinement):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(artifact_files, "copy_model_file", broken)
    with pytest.raises(OSError, match="No space left"):
        run_conversion(ConversionRequest(model=str(llama_dir), **REQUEST), tmp_path / "out",
                       ModelSourceOptions(allowed_roots=(llama_dir.parent,)))
    assert not list(tmp_path.iterdir()) and not _copy_threads()
