"""The entry point every rank of a data-parallel conversion runs (docs/distributed.md; the command:
``python -m converters.distributed``).

Every rank resolves and analyzes the model and builds the calibration batches (the same on all of them), then
runs the layer-sequential calibration on its share of the steps (:mod:`converters.distributed.layer_walk`). Rank 0
alone goes on to convert, export, measure quality and publish the artifact; the others end after calibration. The
resume record beside the output (:func:`~converters.distributed.resume.resume_dir_for`) is written after each layer
and removed once the artifact is published.
"""

from __future__ import annotations

from pathlib import Path

from converters.distributed.job import DistributedJob
from converters.distributed.ranks import RankInfo, end_group, rank_from_environment, start_group
from converters.distributed.resume import ResumeStore, resume_dir_for
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import ConversionResult, run_conversion, run_stages
from converters.pipeline.request import ConversionRequest
from converters.pipeline.state import NullSink, ProgressSink, Run, Stage

__all__ = ["run_ranked_conversion"]


def run_ranked_conversion(request: ConversionRequest, out_dir: Path, sources: ModelSourceOptions,
                          sink: ProgressSink | None = None, *, info: RankInfo | None = None,
                          resume: bool = True) -> ConversionResult | None:
    """Run this process's part of converting ``request`` into ``out_dir``: the whole conversion on rank 0 (returns
    its result), calibration alone on the others (returns None). ``info`` defaults to the rank the environment
    names (:func:`~converters.distributed.ranks.rank_from_environment`: one of one without the variables); the
    process group is joined and left here. ``resume``: keep a resume record and continue from it.

    Raises what :func:`~converters.pipeline.driver.run_conversion` raises, and Fp8ForgeError for rank variables
    that are wrong or a rank count above the calibration steps.
    """
    info = info if info is not None else rank_from_environment()
    out_dir = Path(out_dir)
    job = DistributedJob(info=info, resume_dir=resume_dir_for(out_dir) if resume else None)
    start_group(info)
    try:
        if not info.leader:
            run = Run(request=request, sources=sources, sink=sink or NullSink())
            run.distributed = job
            run_stages(run, stop_after=Stage.CALIBRATE)
            return None
        result = run_conversion(request, out_dir, sources, sink, distributed=job)
        if job.resume_dir is not None:  # published: a restart has nothing left to resume
            ResumeStore(job.resume_dir, "").remove()
        return result
    finally:
        end_group()
