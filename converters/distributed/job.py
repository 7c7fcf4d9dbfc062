"""What the calibrate stage of a rank needs (:class:`DistributedJob`, set on the pipeline's run by
:func:`converters.distributed.entry.run_ranked_conversion`): who this process is and where the resume record lives,
and from them the calibration's layer boundary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from converters.calibration.sequential import LayerStack
from converters.distributed.layer_walk import RankedLayerWalk
from converters.distributed.quality import QualityRun, quality_share
from converters.distributed.ranks import RankInfo
from converters.distributed.resume import ResumeStore, fingerprint
from converters.model.checkpoint import weight_files
from converters.quality.ranks import QualityShare

__all__ = ["DistributedJob"]


@dataclass(frozen=True)
class DistributedJob:
    """What the calibrate stage needs to run as a rank: who this process is, and where the resume record lives."""

    info: RankInfo
    resume_dir: Path | None  #: None: no resume record (the layers are reduced, not recorded)

    def layer_boundary(self, request: Mapping[str, Any], model_dir: Path, stack: LayerStack,
                       batches: list[dict[str, Any]], paths: list[str], *, kv: Any, meter: Any,
                       rounding: Any = None) -> RankedLayerWalk:
        """The calibration's ``boundary`` for this rank, its resume record keyed by the job's fingerprint: the
        ``request`` (as a dict), the model's weight files in ``model_dir`` (names and sizes), the layer list, the
        layers calibrated and the batches' tokens; a record left by anything else is started over.

        ``rounding``: the job's GPTQ rounding (an ``after_layer``), whose streams and files the record keeps too.

        A job with a KV recorder (``kv_cache``) reduces its KV amax and runs each attention layer's scale search
        over every rank's steps at the layer's end, and records both per layer: its scales are the one-rank run's.
        """
        files = [(path.name, path.stat().st_size) for path in weight_files(model_dir)]
        tokens = [value for batch in batches for _, value in sorted(batch.items()) if hasattr(value, "numel")]
        job = fingerprint([dict(request), files, stack.path, stack.count, paths, *tokens])
        store = ResumeStore(self.resume_dir, job) if self.resume_dir is not None else None
        return RankedLayerWalk(self.info, store, stack.path, kv=kv, meter=meter, rounding=rounding)

    def quality_share(self, run: QualityRun, staging: Path) -> QualityShare:
        """This rank's share of the quality pass about to run on ``staging``'s exports (rank 0 tells the others
        where they are: :func:`converters.distributed.quality.quality_share`)."""
        return quality_share(self.info, run, staging)
