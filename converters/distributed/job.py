"""What the calibrate stage of a rank needs (:class:`DistributedJob`, set on the pipeline's run by
:func:`converters.distributed.entry.run_ranked_conversion`): who this process is and where the resume record lives,
and from them the calibration's layer boundary."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from converters.calibration.sequential import LayerStack
from converters.calibration.smoothing_walk import RankShare
from converters.distributed.layer_walk import RankedLayerWalk
from converters.distributed.quality import QualityRun, patient_group, quality_share
from converters.distributed.ranks import RankInfo, every_rank, from_leader
from converters.distributed.resume import ResumeStore, fingerprint
from converters.errors import Fp8ForgeError
from converters.model.checkpoint import weight_files
from converters.quality.ranks import QualityShare
from converters.serving.nvfp4_smoothing import SearchShare

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

    def step_share(self, stack_path: str) -> RankedLayerWalk:
        """A walk over this rank's share of the calibration steps that reduces and records nothing (the smoothing
        search's walk, before calibration, which shares its rows and candidates: :meth:`smoothing_share`)."""
        return RankedLayerWalk(self.info, None, stack_path)

    def smoothing_share(self) -> RankShare:
        """How this rank shares the smoothing walk: every rank's sampled rows on every rank (in rank order, the job's
        step order; on the device its own came from), each mapping's candidates scored between the ranks."""
        def rows(mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            gathered = every_rank(self.info, {name: value.cpu() for name, value in mine.items()})
            return {name: torch.cat([part[name] for part in gathered]).to(value.device) for name, value in mine.items()}

        def combine(errors: dict[int, float]) -> dict[int, float]:
            return {k: error for part in every_rank(self.info, errors) for k, error in part.items()}

        return RankShare(leader=self.info.leader, rows=rows,
                         search=SearchShare(rank=self.info.rank, world_size=self.info.world_size, combine=combine))

    def leaders_directory(self, directory: Path | None, *, what: str, instead: str) -> Path | None:
        """Rank 0's ``directory`` (None: it has none), on every rank, once every rank has checked it can read it: the
        ranks share what rank 0 writes through storage every host reaches, as they share the resume record.

        Raises:
            Fp8ForgeError: on every rank, when one cannot read it (naming the ranks; ``what`` names the directory,
                ``instead`` the way out besides shared storage).
        """
        # rank 0 sends it once written: a whole model's copy may take longer than a layer's timeout
        shared = from_leader(self.info, None if directory is None else str(directory), group=patient_group())
        if shared is None:
            return None
        path = Path(shared)
        readable = every_rank(self.info, (path / "config.json").is_file() and any(path.glob("*.safetensors")))
        unable = [str(rank) for rank, ok in enumerate(readable) if not ok]
        if unable:
            raise Fp8ForgeError(f"rank(s) {', '.join(unable)} cannot read {what} that rank 0 wrote at {path}: the "
                                "ranks of a job share it, as they share the resume record, through storage every host "
                                f"reaches; write the job's output (--out) there, or {instead}")
        return path

    def quality_share(self, run: QualityRun, staging: Path) -> QualityShare:
        """This rank's share of the quality pass about to run on ``staging``'s exports (rank 0 tells the others
        where they are: :func:`converters.distributed.quality.quality_share`)."""
        return quality_share(self.info, run, staging)
