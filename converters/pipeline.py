"""The conversion pipeline: resolve -> analyze -> calibrate -> convert -> export.

Calibration comes before the swap because it measures the high-precision tensors (see
``stages.calibrate``). Where the model's layers form one module list, calibration loads one layer at a
time (``converters.sequential``); otherwise ``resolve`` loads the whole model. The weights themselves
are copied, never decoded (``converters.artifact_layout``).

Each stage is a small function over one :class:`_Run`, reports its progress to a :class:`ProgressSink`,
and checks for cancellation between steps. The output is staged in a hidden sibling directory and
renamed into place only when every file is written, so a failed or cancelled run leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from converters.errors import ConversionCancelled, Fp8ForgeError
from converters.model_sources import ModelSourceOptions
from converters.requests import CalibrationSettings, ConversionRequest

if TYPE_CHECKING:
    import torch
    from torch import nn
    from transformers import PretrainedConfig

    from converters.calibration import LayerAmax
    from converters.checkpoint import Checkpoint
    from converters.formats.serving import ServingPlan
    from converters.recipes import Recipe
    from converters.sequential import LayerStack

__all__ = [
    "STAGES",
    "ProgressSink",
    "NullSink",
    "ConversionRequest",
    "CalibrationSettings",
    "ConversionResult",
    "CalibrationResult",
    "run_conversion",
    "staging_dir_for",
]

logger = logging.getLogger(__name__)

STAGES = ("resolve", "analyze", "calibrate", "convert", "export")


class ProgressSink(Protocol):
    """Where the pipeline reports; the CLI draws progress bars, the worker stores events."""

    def stage(self, name: str) -> None: ...

    def progress(self, done: int, total: int) -> None: ...

    def warning(self, message: str) -> None: ...

    def should_stop(self) -> bool: ...


class NullSink:
    """A sink that records warnings and never asks to stop."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def stage(self, name: str) -> None:
        logger.info("stage %s", name)

    def progress(self, done: int, total: int) -> None:
        pass

    def warning(self, message: str) -> None:
        self.warnings.append(message)

    def should_stop(self) -> bool:
        return False


@dataclass
class ConversionResult:
    out_dir: Path
    files: list[str]
    manifest: list[dict[str, Any]]
    report_path: Path
    converted: list[str]
    pipeline: dict[str, Any]  #: ``mode`` (layer_sequential or whole_model), ``reason``, ``device``
    converted_experts: list[str] = field(default_factory=list)  #: ``<experts>.<gemm>`` converted together


@dataclass
class CalibrationResult:
    """What the calibrate stage produced (and the TE check added), for the convert and export stages."""

    data_source: str = ""
    amax: dict[str, LayerAmax] = field(default_factory=dict)  #: layer path -> amax per step
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)  #: layer path -> scaling state
    check_batch: dict[str, Any] | None = None  #: the first calibration batch, for the whole-model TE check
    te_check: dict[str, Any] = field(
        default_factory=lambda: {"ran": False, "reason": "TransformerEngine not used here"})


@dataclass
class _Run:
    """What the stages hand to each other."""

    request: ConversionRequest
    sources: ModelSourceOptions
    sink: ProgressSink
    recipe: Recipe | None = None
    model_dir: Path | None = None
    config: PretrainedConfig | None = None
    report: dict[str, Any] | None = None
    meta_model: nn.Module | None = None  #: built on the meta device; the layer-sequential mode loads into it
    checkpoint: Checkpoint | None = None  #: the source's weight files, indexed
    stack: LayerStack | None = None  #: None in whole-model mode
    pipeline: dict[str, Any] = field(default_factory=dict)  #: mode, reason, device (for the report)
    model: nn.Module | None = None  #: the loaded model, whole-model mode only
    converted: list[str] = field(default_factory=list)
    weights_on_disk: dict[str, str] = field(default_factory=dict)
    serving: dict[str, ServingPlan] = field(default_factory=dict)  #: format name -> its plan
    te_modules: bool = False
    calibration: CalibrationResult = field(default_factory=lambda: CalibrationResult())
    tied_weights: dict[str, str] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    export_started: float = 0.0  #: time.perf_counter() when the export stage began
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str) -> None:
        if message in self.warnings:  # a check that runs at several stages says its piece once
            return
        self.warnings.append(message)
        self.sink.warning(message)

    def check_stop(self) -> None:
        if self.sink.should_stop():
            raise ConversionCancelled("the conversion was cancelled")


def staging_dir_for(out_dir: Path) -> Path:
    """The hidden sibling a run of ``out_dir`` writes into before the final rename."""
    return out_dir.parent / f".{out_dir.name}.partial"


def run_conversion(
    request: ConversionRequest, out_dir: Path, sources: ModelSourceOptions, sink: ProgressSink | None = None,
    *, notes: tuple[str, ...] | list[str] = (),
) -> ConversionResult:
    """Convert ``request.model`` and write its artifacts to ``out_dir`` (which must not exist).

    ``notes`` are warnings the caller found before the run (a recipe file's keys that the request's recipe
    object no longer holds); they are reported first, and kept in the report with the pipeline's own.

    Raises:
        Fp8ForgeError subclasses: bad input (``is_bad_input``), backend unavailable, inconsistent
            conversion, or ConversionCancelled when ``sink.should_stop()`` turned true.
    """
    from converters import stages

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise Fp8ForgeError(f"output directory {out_dir} already exists; choose a new one", field="out")
    if not out_dir.parent.is_dir():
        raise Fp8ForgeError(f"the parent of {out_dir} does not exist; create {out_dir.parent} first", field="out")
    run = _Run(request=request, sources=sources, sink=sink or NullSink())
    for note in notes:
        run.warn(note)
    staging = staging_dir_for(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        for stage in (stages.resolve, stages.analyze, stages.calibrate, stages.convert):
            run.check_stop()
            run.sink.stage(stage.__name__)
            started = time.perf_counter()
            stage(run)
            run.stage_seconds[stage.__name__] = round(time.perf_counter() - started, 3)
        run.check_stop()
        run.sink.stage("export")
        run.export_started = time.perf_counter()  # export records its own time in the report it writes
        files, manifest = stages.export(run, staging)
        run.check_stop()
        os.replace(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report_path = out_dir / "fp8_report.json"
    from converters.analysis import converted_expert_gemms

    return ConversionResult(out_dir=out_dir, files=files, manifest=manifest, report_path=report_path,
                            converted=run.converted, pipeline=run.pipeline,
                            converted_experts=converted_expert_gemms(run.report))
