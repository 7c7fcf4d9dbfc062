"""Data-parallel, resumable calibration over torch.distributed ranks (docs/distributed.md)."""

from converters.distributed.entry import run_ranked_conversion
from converters.distributed.job import DistributedJob
from converters.distributed.ranks import RANK_VARIABLES, RankInfo, rank_from_environment, steps_of_rank

__all__ = ["DistributedJob", "RANK_VARIABLES", "RankInfo", "rank_from_environment", "run_ranked_conversion",
           "steps_of_rank"]
