"""The entry point every rank of a data-parallel conversion runs (docs/distributed.md; the command:
``python -m converters.distributed``).

Every rank resolves and analyzes the model and builds the calibration batches (the same on all of them), then
runs the layer-sequential calibration on its share of the steps (:mod:`converters.distributed.layer_walk`). Rank 0
alone goes on to convert, export and publish the artifact; the others wait for its quality pass, score their share
of its texts (:mod:`converters.distributed.quality`) and end once it has published. The
resume record beside the output (:func:`~converters.distributed.resume.resume_dir_for`) is written after each layer
and removed once the artifact is published.
"""

from __future__ import annotations

import os
from pathlib import Path

from converters.distributed.job import DistributedJob
from converters.distributed.quality import end_quality, follow_quality, start_quality_group
from converters.distributed.ranks import RankInfo, end_group, rank_from_environment, start_group
from converters.distributed.resume import ResumeStore, resume_dir_for
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import ConversionResult, run_conversion, run_stages
from converters.pipeline.quality_report import quality_block
from converters.pipeline.request import ConversionRequest
from converters.pipeline.serving_export import ServingShardRunner
from converters.pipeline.state import NullSink, ProgressSink, Run, Stage

__all__ = ["run_ranked_conversion"]


def run_ranked_conversion(request: ConversionRequest, out_dir: Path, sources: ModelSourceOptions,
                          sink: ProgressSink | None = None, *, info: RankInfo | None = None,
                          resume_dir: Path | None = None, resume: bool = True,
                          serving_shards: ServingShardRunner | None = None) -> ConversionResult | None:
    """Run this process's part of converting ``request`` into ``out_dir``: the whole conversion on rank 0 (returns
    its result), calibration alone on the others (returns None). ``info`` defaults to the rank the environment
    names (:func:`~converters.distributed.ranks.rank_from_environment`); the process group is joined and left here.

    ``resume_dir``: where the resume record lives (default: beside ``out_dir``, :func:`resume_dir_for`); a caller
    whose attempts write different ``out_dir`` (the service) passes one per job so that a new attempt finds it. Only
    rank 0's counts: the others are told it. ``resume`` False keeps no record. A process with no rank variables,
    no ``info`` and no ``resume_dir`` is the ordinary one-process run (no record). ``serving_shards``: as for
    :func:`~converters.pipeline.driver.run_conversion` (rank 0).

    Raises what :func:`~converters.pipeline.driver.run_conversion` raises, and Fp8ForgeError for rank variables
    that are wrong or a rank count above the calibration steps.
    """
    out_dir = Path(out_dir)
    if info is None and resume_dir is None and "WORLD_SIZE" not in os.environ:
        return run_conversion(request, out_dir, sources, sink, serving_shards=serving_shards)
    info = info if info is not None else rank_from_environment()
    record = (Path(resume_dir) if resume_dir is not None else resume_dir_for(out_dir)) if resume else None
    job = DistributedJob(info=info, resume_dir=record)
    start_group(info)
    try:
        if info.world_size > 1:
            start_quality_group()
        if not info.leader:
            run = Run(request=request, sources=sources, sink=sink or NullSink())
            run.distributed = job
            run_stages(run, stop_after=Stage.CALIBRATE)
            follow_quality(info, run, quality_block)
            return None
        result = run_conversion(request, out_dir, sources, sink, serving_shards=serving_shards, distributed=job)
        if record is not None:  # published: a restart has nothing left to resume
            ResumeStore(record, "").remove()
        end_quality(info)
        return result
    finally:
        end_group()
