"""The conversion pipeline: resolve -> analyze -> calibrate -> convert -> export -> quality (-> plan).

Calibration comes before the swap because it measures the high-precision tensors (see
``stages.calibrate``). Where the model's layers form one module list, calibration loads one layer at a
time (``converters.calibration.sequential``); otherwise ``resolve`` loads the whole model. The weights themselves
are copied, never decoded (``converters.artifact.layout``).

Each stage is a small function over one :class:`~converters.pipeline.state.Run` that returns its record (stored
in the run once) and reports its progress to a :class:`ProgressSink`; the driver announces and times each one and
checks for cancellation between them. The report, config and manifest are written after the last stage
(:func:`~converters.pipeline.artifact_stages.finish`), so the report holds every stage's time. The output is
staged in a hidden sibling directory and renamed into place only when every file is written, so a failed or
cancelled run leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from converters.analysis.eligibility import converted_expert_gemms
from converters.artifact.layout import REPORT_FILE, staging_dir_for
from converters.errors import Fp8ForgeError
from converters.model.sources import ModelSourceOptions
from converters.pipeline.artifact_stages import export, finish, precision_plan, quality
from converters.pipeline.request import ConversionRequest
from converters.pipeline.serving_export import ServingShardRunner
from converters.pipeline.source_smoothing import remove_smoothed_source, smooths_source
from converters.pipeline.stages import STAGE_FUNCTIONS, start
from converters.pipeline.state import NullSink, ProgressSink, Run, Stage
from converters.pipeline.weight_copy import start_weight_copy

if TYPE_CHECKING:
    from converters.distributed.job import DistributedJob

__all__ = ["ConversionResult", "run_stages", "run_stage", "run_conversion"]

T = TypeVar("T")


@dataclass
class ConversionResult:
    out_dir: Path
    files: list[str]
    manifest: list[dict[str, Any]]
    report_path: Path
    converted: list[str]
    pipeline: dict[str, Any]  #: ``mode`` (layer_sequential or whole_model), ``reason``, ``device``
    converted_experts: list[str] = field(default_factory=list)  #: ``<experts>.<gemm>`` converted together


def run_stages(run: Run, *, stop_after: Stage, after_resolve: Callable[[Run], None] | None = None) -> None:
    """Run the stages from resolve through ``stop_after`` (not export, which needs a directory), in order, with
    progress, cancellation checks and timings. The conversion stops after convert, the synchronous analysis after
    calibrate. Each stage's record is stored in the run under the stage's field, once."""
    start(run)
    for stage, function, record_field in STAGE_FUNCTIONS:
        setattr(run, record_field, run_stage(run, stage, function, run))
        if stage is Stage.RESOLVE and after_resolve is not None:
            after_resolve(run)
        if stage is stop_after:
            return


def run_stage(run: Run, stage: Stage, function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` as ``stage``: after a cancellation check, announced to the sink and timed into
    ``run.stage_seconds``; returns what it returns."""
    run.check_stop()
    run.sink.stage(stage.value)
    started = time.perf_counter()
    result = function(*args)
    run.stage_seconds[stage.value] = round(time.perf_counter() - started, 3)
    return result


def run_conversion(
    request: ConversionRequest, out_dir: Path, sources: ModelSourceOptions, sink: ProgressSink | None = None,
    *, notes: tuple[str, ...] | list[str] = (), serving_shards: ServingShardRunner | None = None,
    distributed: DistributedJob | None = None,
) -> ConversionResult:
    """Convert ``request.model`` and write its artifacts to ``out_dir`` (which must not exist).

    ``notes`` are warnings the caller found before the run (a recipe file's keys that the request's recipe
    object no longer holds); they are reported first, and kept in the report with the pipeline's own.
    ``serving_shards``: who writes the serving exports' weight files, as tasks (``write_serving_exports``);
    without it, the run writes them itself. ``distributed``: this process is rank 0 of a data-parallel or resumable
    job (:func:`converters.distributed.run_ranked_conversion` passes it).

    Raises:
        Fp8ForgeError subclasses: bad input (``is_bad_input``), backend unavailable, inconsistent
            conversion, or ConversionCancelled when ``sink.should_stop()`` turned true.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise Fp8ForgeError(f"output directory {out_dir} already exists; choose a new one", field="out")
    if not out_dir.parent.is_dir():
        raise Fp8ForgeError(f"the parent of {out_dir} does not exist; create {out_dir.parent} first", field="out")
    run = Run(request=request, sources=sources, sink=sink or NullSink(), distributed=distributed)
    for note in notes:
        run.warn(note)
    staging = staging_dir_for(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    run.staging = staging
    def copy_beside_calibration(run: Run) -> None:  # the copy needs only the files: it runs beside calibration
        if not smooths_source(run.recipe):  # else it starts from the source the job converts, once that is written
            start_weight_copy(run)

    try:
        run_stages(run, stop_after=Stage.CONVERT, after_resolve=copy_beside_calibration)
        written = run_stage(run, Stage.EXPORT, export, run, staging, serving_shards)
        run.quality = run_stage(run, Stage.QUALITY, quality, run, staging)
        if run.request.plan is not None:
            written += run_stage(run, Stage.PLAN, precision_plan, run, staging)
        run.check_stop()
        files, manifest = finish(run, staging, written)
        remove_smoothed_source(staging)  # the source the job read (nvfp4_smoothing), not an artifact file
        run.check_stop()
        os.replace(staging, out_dir)
    except BaseException:
        if run.weight_copy is not None:
            run.weight_copy.abandon()
        shutil.rmtree(staging, ignore_errors=True)
        raise
    report_path = out_dir / REPORT_FILE
    return ConversionResult(out_dir=out_dir, files=files, manifest=manifest, report_path=report_path,
                            converted=run.conversion.modules, pipeline=run.pipeline,
                            converted_experts=converted_expert_gemms(run.report))
