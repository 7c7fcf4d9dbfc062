"""The stages after convert, over the staging directory: export (the weight, state, calibration and serving files),
quality (the end-to-end pass that reads the serving exports back), plan (the precision plan, when the request asks
one), then the report, config and manifest, written last (:func:`finish`).

Each reports its steps to the run's sink; the driver announces and times them, so the report's ``stage_seconds``
holds every one. The files a stage writes are checksummed in that stage, so the manifest at the end reads only
the few small files written after them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import converters.pipeline.export as writers
from converters.artifact.files import copy_side_files, write_manifest
from converters.artifact.layout import sha256_file
from converters.model.sources import confinement_for
from converters.pipeline.progress import Unit
from converters.pipeline.quality_report import quality_block
from converters.pipeline.serving_export import ServingShardRunner, write_serving_exports
from converters.pipeline.state import Run
from converters.plan.job import plan_for_job

__all__ = ["export", "quality", "precision_plan", "finish"]


def export(run: Run, staging: Path, serving_shards: ServingShardRunner | None = None) -> list[str]:
    """Write the weights (copied), FP8 state, calibration, side files and serving exports into ``staging``;
    returns their names (``serving_shards``: who writes the serving exports' weight files, see
    ``write_serving_exports``)."""
    steps = ["copying the weight files", "writing the state and calibration files",
             *(["writing the serving exports"] * bool(run.serving)), "checksumming the files"]
    def step(name: str) -> None:
        run.check_stop()
        run.sink.progress(steps.index(name), len(steps), Unit.STEP, step=name)

    step(steps[0])
    written = writers.write_weight_files(run, staging)
    if run.weight_copy is not None:
        run.digests.update(run.weight_copy.digests())
    step(steps[1])
    written += writers.write_state_file(run, staging)
    written += writers.write_calibration_file(run, staging)
    written += copy_side_files(run.resolved.directory, staging, confinement_for(run.sources))
    if run.serving:
        step(steps[2])
        written += write_serving_exports(run, staging, serving_shards)
    step(steps[-1])
    _checksum(run, staging, written)
    run.sink.progress(len(steps), len(steps), Unit.STEP)
    return written


def quality(run: Run, staging: Path) -> dict[str, Any]:
    """The report's end-to-end quality block (:func:`~converters.pipeline.quality_report.quality_block`), its pass
    counted in layers."""
    return quality_block(run, staging, on_layer=lambda done, total: run.sink.progress(done, total, Unit.LAYER))


def precision_plan(run: Run, staging: Path) -> list[str]:
    """The request's precision plan: its search (quality passes) and its files in ``staging/plan/``
    (:func:`converters.plan.job.plan_for_job`); the block goes to ``run.plan_block``. Returns the files."""
    run.sink.progress(0, 1, Unit.STEP, step="searching the plan and writing its checkpoints")
    run.plan_block, files = plan_for_job(run, staging)
    _checksum(run, staging, files)
    run.sink.progress(1, 1, Unit.STEP)
    return files


def finish(run: Run, staging: Path, written: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """Write config.json, the report (every stage timed by now) and the manifest; returns every file's name and
    the manifest's entries."""
    written = [*written, *writers.write_json_files(run, staging, written)]
    manifest = write_manifest(staging, known=run.digests)
    return sorted({*written, "manifest.json"}), manifest


def _checksum(run: Run, staging: Path, names: list[str]) -> None:
    """The sha256 of each file named that is not known yet, for the manifest (the files are final once written)."""
    for name in names:
        if name not in run.digests:
            run.digests[name] = sha256_file(staging / name)
