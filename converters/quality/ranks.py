"""The quality pass shared by the ranks of a data-parallel job (:mod:`converters.distributed`).

Each rank scores a contiguous block of the texts (:meth:`QualityShare.texts`) and the sums of every variant are
added over the ranks in rank order, which is the texts' order (:func:`summed_over_ranks`): the figures are the
one-process run's up to float summation order and the head's GEMM blocking (its blocks of positions span texts).
A rank that cannot run its part sends its reason instead of sums, and every rank then reports the pass unavailable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from converters.quality.figures import QualityUnavailable, TokenScores

__all__ = ["QualityShare", "summed_over_ranks"]


@dataclass(frozen=True, kw_only=True)
class QualityShare:
    """This process's part of a quality pass shared by the ranks of a data-parallel job (every rank calls
    :func:`measure_qualities` with the same source, variants and texts)."""

    rank: int
    world_size: int
    #: every rank's object, in rank order (an all-gather over the job's ranks; a collective): its ``ran`` attribute,
    #: where it has one, says whether it was called
    gather: Callable[[Any], list[Any]]

    @property
    def gathered(self) -> bool:
        return bool(getattr(self.gather, "ran", False))

    def texts(self, count: int) -> range:
        """The indices of the texts this rank scores: a contiguous block, the first ``count % world_size`` ranks
        one longer (a rank may have none: it still takes part in the gather)."""
        base, longer = divmod(count, self.world_size)
        start = self.rank * base + min(self.rank, longer)
        return range(start, start + base + (1 if self.rank < longer else 0))


def summed_over_ranks(share: QualityShare, scores: dict[str, TokenScores]) -> dict[str, TokenScores]:
    """Every rank's sums added in rank order (the texts' order); kl_max the largest. A rank that could not run
    the pass (its reason instead of sums) makes it unavailable on every rank."""
    gathered = share.gather({name: vars(score) for name, score in scores.items()})
    failed = [(rank, part) for rank, part in enumerate(gathered) if isinstance(part, str)]
    if failed:
        rank, reason = failed[0]
        raise QualityUnavailable(f"rank {rank} of {share.world_size} could not run the quality pass: {reason}",
                                 field="model")
    total = {name: TokenScores() for name in scores}
    for part in gathered:
        for name, sums in part.items():
            score = total[name]
            score.nll_reference += sums["nll_reference"]
            score.nll += sums["nll"]
            score.kl_sum += sums["kl_sum"]
            score.kl_max = max(score.kl_max, sums["kl_max"])
            score.agree += sums["agree"]
            score.tokens += sums["tokens"]
    return total
