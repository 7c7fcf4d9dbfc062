"""The run state the pipeline stages hand to each other, the stage list, and where progress goes.

Torch-free: the service imports :class:`Stage` from here.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from converters.calibration.result import NO_TE_CHECK, CalibrationResult
from converters.errors import ConversionCancelled
from converters.model.sources import ModelSourceOptions
from converters.pipeline.progress import Unit
from converters.pipeline.request import ConversionRequest

if TYPE_CHECKING:
    from torch import nn
    from transformers import PretrainedConfig

    from converters.backends.base import Backend, ConversionTargets, Converted
    from converters.calibration.sequential import LayerStack
    from converters.distributed.job import DistributedJob
    from converters.model.checkpoint import Checkpoint
    from converters.pipeline.weight_copy import BackgroundWeightCopy
    from converters.recipes import Recipe
    from converters.serving.selection import ServingSelection

__all__ = ["Stage", "STAGES", "ProgressSink", "NullSink", "ResolvedModel", "Run", "job_stages"]

logger = logging.getLogger(__name__)


class Stage(str, enum.Enum):
    """Pipeline stages, in the order they run (a requantize job runs analyze, convert and export alone)."""

    RESOLVE = "resolve"
    ANALYZE = "analyze"
    CALIBRATE = "calibrate"  # in high precision, before the swap
    CONVERT = "convert"
    EXPORT = "export"  # the weight, state, calibration and serving files
    QUALITY = "quality"  # the end-to-end quality pass: it reads the serving exports back
    PLAN = "plan"  # the precision plan's search and files, when the request asks for one


STAGES: tuple[Stage, ...] = tuple(Stage)
_MODEL_FREE_STAGES = (Stage.ANALYZE, Stage.CONVERT, Stage.EXPORT)


def job_stages(request: Mapping[str, Any]) -> tuple[Stage, ...]:
    """The stages a job of ``request`` (its stored dict) runs, in order: a requantize job's plan, shards and finish
    count as analyze, convert and export; a conversion runs plan only when it asks for one."""
    if request.get("requantize") is not None:
        return _MODEL_FREE_STAGES
    return tuple(stage for stage in STAGES if stage is not Stage.PLAN or request.get("plan") is not None)


class ProgressSink(Protocol):
    """Where the pipeline reports; the CLI draws progress bars, the worker stores events."""

    def stage(self, name: str) -> None: ...

    def progress(self, done: int, total: int, unit: Unit | str = Unit.STEP, **detail: Any) -> None:
        """``done`` of ``total`` counted in ``unit``; ``detail``: the optional fields of
        :func:`converters.pipeline.progress.progress_event` (``step``, shards, bytes)."""

    def warning(self, message: str) -> None: ...

    def should_stop(self) -> bool: ...


class NullSink:
    """A sink that records warnings and never asks to stop."""

    def __init__(self) -> None:
        self.warnings: list[str] = []

    def stage(self, name: str) -> None:
        logger.info("stage %s", name)

    def progress(self, done: int, total: int, unit: Unit | str = Unit.STEP, **detail: Any) -> None:
        pass

    def warning(self, message: str) -> None:
        self.warnings.append(message)

    def should_stop(self) -> bool:
        return False


@dataclass(frozen=True)
class ResolvedModel:
    """What the resolve stage found: the model's files, its config, its shape and how it will be calibrated."""

    directory: Path  #: the local directory holding config.json, the weights and the tokenizer
    config: PretrainedConfig
    meta_model: nn.Module  #: built on the meta device; the layer-sequential mode loads into it
    checkpoint: Checkpoint  #: the source's weight files, indexed (headers only)
    stack: LayerStack | None  #: the decoder layers, for layer-by-layer calibration; None in whole-model mode
    tied_weights: dict[str, str]  #: tied parameter -> the parameter it shares storage with
    mode: str  #: ``layer_sequential`` or ``whole_model``, as resolve chose it
    mode_reason: str  #: why that mode
    device: str  #: ``cuda`` or ``cpu``


@dataclass
class Run:
    """What the stages hand to each other: the request, the recipe and its backend, then each stage's record.

    Each stage function returns its record and the driver stores it under the stage's field
    (``STAGE_RECORDS``); the records are set once. The few things a stage leaves beside its record are named
    below with the stage that sets them.
    """

    request: ConversionRequest
    sources: ModelSourceOptions
    sink: ProgressSink
    recipe: Recipe | None = None  #: parsed once, when the run starts
    backend: Backend | None = None  #: chosen by the recipe's type when the run starts (backend_for), once
    resolved: ResolvedModel | None = None  #: resolve's record
    report: dict[str, Any] | None = None  #: analyze's record (calibrate adds the SQNR and experts blocks to it)
    calibration: CalibrationResult | None = None  #: calibrate's record
    conversion: Converted | None = None  #: convert's record: what the backend did
    targets: ConversionTargets | None = None  #: set by convert: what the backend was asked to convert
    model: nn.Module | None = None  #: the loaded model, whole-model mode only (resolve, or calibrate's fallback)
    mode_fallback: str | None = None  #: set by calibrate: why layer-sequential calibration gave way to whole-model
    weights_on_disk: dict[str, str] = field(default_factory=dict)  #: set by convert
    #: the source's weight files being copied into the artifact during calibration (set by the driver)
    weight_copy: BackgroundWeightCopy | None = None
    #: format name -> what it quantizes; set by analyze, selected again by calibrate when min_sqnr_db drops layers
    serving: dict[str, ServingSelection] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    #: the quality stage's record: the report's end-to-end quality block
    quality: dict[str, Any] | None = None
    #: set by the plan stage (a request with ``plan``): the report's plan block
    plan_block: dict[str, Any] | None = None
    #: each artifact file's sha256 by name, as the stage that wrote it computed it (for the manifest)
    digests: dict[str, str] = field(default_factory=dict)
    #: set by calibrate when it loads one: the model's tokenizer, which the quality pass reads again
    tokenizer: Any = None
    #: set by the caller of a rank of a data-parallel or resumable job (converters.distributed): calibrate reads it
    distributed: DistributedJob | None = None
    #: the artifact's staging directory, set by the driver before the stages run (calibration may leave files there
    #: for export: GPTQ-rounded weights)
    staging: Path | None = None
    warnings: list[str] = field(default_factory=list)

    #: what one stage makes and the later stages only read: set once (a second assignment is a bug, raised)
    SET_ONCE: ClassVar[frozenset[str]] = frozenset({
        "backend", "recipe", "resolved", "model", "report", "calibration", "targets", "conversion", "mode_fallback",
        "quality", "plan_block"})

    @property
    def pipeline(self) -> dict[str, Any]:
        """The report's ``pipeline`` block: mode, why, device."""
        if self.resolved is None:
            return {}
        if self.mode_fallback is not None:
            return {"mode": "whole_model", "reason": self.mode_fallback, "device": self.resolved.device}
        return {"mode": self.resolved.mode, "reason": self.resolved.mode_reason, "device": self.resolved.device}

    @property
    def te_check(self) -> dict[str, Any]:
        """The report's TE check: the conversion's own, or else the one calibration ran layer by layer."""
        if self.conversion is not None and self.conversion.te_check is not None:
            return self.conversion.te_check
        return self.calibration.te_check if self.calibration is not None else dict(NO_TE_CHECK)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.SET_ONCE and getattr(self, name, None) is not None:
            raise AttributeError(f"Run.{name} is set once, by the stage that makes it; it was set already")
        super().__setattr__(name, value)

    def use_derived_source(self, resolved: ResolvedModel, sources: ModelSourceOptions) -> None:
        """Make ``resolved`` (a source the job wrote from its own: the smoothed copy of ``nvfp4_smoothing``, the same
        model's function) the source every later stage reads, with ``sources`` admitting its files. The one
        replacement of ``resolved``, before calibration reads it."""
        if self.calibration is not None:
            raise AttributeError("the run's source can change only before calibration")
        super().__setattr__("resolved", resolved)
        self.sources = sources

    def warn(self, message: str) -> None:
        if message in self.warnings:  # a check that runs at several stages says its piece once
            return
        self.warnings.append(message)
        self.sink.warning(message)

    def check_stop(self) -> None:
        if self.sink.should_stop():
            raise ConversionCancelled("the conversion was cancelled")
