"""The quality pass of a data-parallel job, shared by its ranks (docs/distributed.md).

Rank 0 alone converts and writes the exports; the quality pass reads them back, so the other ranks, once they
have calibrated, wait for rank 0 to reach it (:func:`follow_quality`). When rank 0's pass starts
(:func:`quality_share`) it sends them where its staged exports are, on storage every rank reaches (the resume
record's condition), and the report and serving selections the pass reads; every rank then builds the same variants,
scores its block of the texts and the sums are added over the ranks (:class:`~converters.quality.measure.
QualityShare`). After publishing, rank 0 sends the end (:func:`end_quality`). These exchanges go through a gloo group
without the calibration's timeout: the others wait through rank 0's conversion and export, which take longer than a
layer does.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from converters.distributed.ranks import RankInfo, every_rank, from_leader
from converters.quality.ranks import QualityShare

__all__ = ["QUALITY_WAIT_S", "QualityRun", "end_quality", "follow_quality", "patient_group", "quality_share",
           "start_quality_group"]

logger = logging.getLogger(__name__)


class QualityRun(Protocol):
    """What the ranks share of a job's run (``converters.pipeline.state.Run``, which sits above this package): the
    report and serving selections rank 0's convert stage left."""

    report: dict[str, Any]
    serving: Any

#: how long a rank waits for rank 0 to reach its quality pass (its conversion and export of a 671B model included)
QUALITY_WAIT_S = 24 * 3600

_GROUP: list[Any] = []  #: the gloo group of these exchanges, once joined (start_quality_group)
_LAST: list[_Gather] = []  #: the gather of the pass this process last started (quality_share)


def start_quality_group() -> None:
    """Join the exchanges' group: every rank, right after the job's group (a collective)."""
    import torch.distributed as dist

    _GROUP[:] = [dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=QUALITY_WAIT_S))]


def patient_group() -> Any:
    """The exchanges' group (None before :func:`start_quality_group`: the job's own), also for another wait on rank 0
    that can outlast a layer's timeout (its write of a smoothed copy of the whole model)."""
    return _GROUP[0] if _GROUP else None


class _Gather:
    """An all-gather of objects over the job's ranks, on the patient group, which remembers whether it ran."""

    def __init__(self, info: RankInfo) -> None:
        self.info = info
        self.ran = False

    def __call__(self, mine: Any) -> list[Any]:
        self.ran = True
        return every_rank(self.info, mine, group=patient_group())


def quality_share(info: RankInfo, run: QualityRun, staging: Path) -> QualityShare:
    """This rank's share of the quality pass about to run; rank 0 first tells the waiting ranks where its
    exports are (``staging``), with the report and serving selections the pass reads."""
    if info.world_size == 1:
        return QualityShare(rank=0, world_size=1, gather=lambda mine: [mine])
    if info.leader:
        from_leader(info, {"staging": str(staging), "report": run.report, "serving": run.serving},
                    group=patient_group())
    _LAST[:] = [_Gather(info)]  # follow_quality checks that it ran
    return QualityShare(rank=info.rank, world_size=info.world_size, gather=_LAST[0])


def follow_quality(info: RankInfo, run: QualityRun, quality_block: Callable[[Any, Path], dict[str, Any]]) -> None:
    """A rank other than 0, after calibrating: run each quality pass rank 0 announces, until it says the job is
    published. ``quality_block``: the pipeline's pass (``converters.pipeline.quality_report.quality_block``; an
    argument because the pipeline sits above this package). Raises what the pass raises past its own handling,
    and a lost rank 0's error."""
    while (message := from_leader(info, None, group=patient_group())) is not None:
        # rank 0's, as its convert stage left them (the report is set once: its contents are replaced)
        run.report.clear()
        run.report.update(message["report"])
        run.serving = message["serving"]
        _LAST.clear()
        block = quality_block(run, Path(message["staging"]))
        if not _LAST or not _LAST[0].ran:
            # this rank stopped before the pass that rank 0 runs: its reason makes the figures unavailable there
            reason = block.get("reason", "the pass did not start")
            logger.warning("quality pass not run on this rank: %s", reason)
            _Gather(info)(reason)


def end_quality(info: RankInfo) -> None:
    """Rank 0, once the artifact is published: the waiting ranks may end."""
    if info.leader:
        from_leader(info, None, group=patient_group())
