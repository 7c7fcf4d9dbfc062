"""The run state: each stage returns its record, the driver stores it once, and a second assignment is a bug."""

from __future__ import annotations

import dataclasses

import pytest

from converters.calibration.result import CalibrationResult
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import run_stages
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.pipeline.stages import STAGE_FUNCTIONS, analyze, resolve, start
from converters.pipeline.state import NullSink, ResolvedModel, Run, Stage


def _run(llama_dir) -> Run:
    request = ConversionRequest(model=str(llama_dir), recipe={"backend": "ao"},
                                calibration=CalibrationSettings(steps=1, seq_len=16))
    return Run(request=request, sources=ModelSourceOptions(allowed_roots=(llama_dir.parent,)), sink=NullSink())


def test_a_stage_returns_its_record_and_leaves_the_run_to_the_driver(llama_dir):
    run = _run(llama_dir)
    start(run)
    resolved = resolve(run)
    assert isinstance(resolved, ResolvedModel) and run.resolved is None
    assert resolved.mode == "layer_sequential" and resolved.device == "cpu"
    run.resolved = resolved
    report = analyze(run)
    assert run.report is None and report["totals"]["eligible_layers"] > 0


def test_the_driver_stores_each_record_once(llama_dir):
    run = _run(llama_dir)
    run_stages(run, stop_after=Stage.CALIBRATE)
    assert isinstance(run.calibration, CalibrationResult) and run.calibration.amax
    assert run.conversion is None  # stopped after calibrate
    assert run.pipeline == {"mode": "layer_sequential", "reason": run.resolved.mode_reason, "device": "cpu"}
    forward = run.calibration.forward  # what the layer forwards ran in, for the report's calibration block
    assert forward["compute_dtype"] in ("bfloat16", "float32") and forward["checkpoint_dtype"] == "bfloat16"
    assert "dot products" in forward["compute_reason"] and forward["prefetch"] is True
    for _, _, record_field in STAGE_FUNCTIONS[:3]:
        with pytest.raises(AttributeError, match=f"Run.{record_field} is set once"):
            setattr(run, record_field, getattr(run, record_field))
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.calibration.amax = {}  # calibrate's record is made whole, once
    assert [stage for stage, _, _ in STAGE_FUNCTIONS] == [Stage.RESOLVE, Stage.ANALYZE, Stage.CALIBRATE, Stage.CONVERT]
