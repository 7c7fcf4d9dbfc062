"""Which rank this process is, read from the standard torch.distributed environment, and its share of the steps.

torchrun and a Slurm ``srun`` wrapper start every rank with ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``
and ``MASTER_PORT`` (docs/distributed.md). A process started without them is one rank of one: nothing is
initialised and the job runs as it always did.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from converters.errors import Fp8ForgeError

__all__ = ["RANK_VARIABLES", "RankInfo", "end_group", "every_rank", "from_leader",
           "rank_from_environment", "start_group", "steps_of_rank"]

#: the variables a launcher sets for every rank (MASTER_ADDR/MASTER_PORT: where rank 0 listens for the others)
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
#: how long a collective waits for the slowest rank: a layer of a 671B model on one rank takes minutes, and a rank
#: that died is noticed sooner, when its connection closes
DEFAULT_TIMEOUT_S = 1800


@dataclass(frozen=True, kw_only=True)
class RankInfo:
    """One process of a data-parallel job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0  #: the rank's index on its host (its GPU there)
    master_addr: str = ""
    master_port: int = 0

    @property
    def leader(self) -> bool:
        """Rank 0 writes the artifact, the exports and the resume record; the others only calibrate."""
        return self.rank == 0


def _integer(env: Mapping[str, str], name: str, low: int) -> int:
    text = env.get(name, "")
    try:
        value = int(text)
    except ValueError:
        raise Fp8ForgeError(f"{name}={text!r} is not an integer; the launcher (torchrun, srun) sets it for each rank: "
                            "start the rank through it, or unset all of " + ", ".join(RANK_VARIABLES),
                            field=name) from None
    if value < low:
        raise Fp8ForgeError(f"{name}={value} must be at least {low}", field=name)
    return value


def rank_from_environment(env: Mapping[str, str] | None = None) -> RankInfo:
    """This process's rank: one of one when ``WORLD_SIZE`` is unset, else read and checked from the variables.

    Raises Fp8ForgeError naming the variable that is missing or wrong (a rank past the world, no master address).
    """
    env = os.environ if env is None else env
    if "WORLD_SIZE" not in env:
        return RankInfo()
    missing = [name for name in RANK_VARIABLES if not env.get(name)]
    if missing:
        raise Fp8ForgeError(f"WORLD_SIZE is set but {', '.join(missing)} is not: a rank needs all of "
                            f"{', '.join(RANK_VARIABLES)} (torchrun and srun set them)", field=missing[0])
    world = _integer(env, "WORLD_SIZE", 1)
    rank = _integer(env, "RANK", 0)
    if rank >= world:
        raise Fp8ForgeError(f"RANK={rank} is not below WORLD_SIZE={world}; ranks are numbered 0 to {world - 1}",
                            field="RANK")
    port = _integer(env, "MASTER_PORT", 1)
    if port > 65535:
        raise Fp8ForgeError(f"MASTER_PORT={port} is not a TCP port (1-65535)", field="MASTER_PORT")
    return RankInfo(rank=rank, world_size=world, local_rank=_integer(env, "LOCAL_RANK", 0),
                    master_addr=env["MASTER_ADDR"], master_port=port)


def steps_of_rank(rank: int, world_size: int, total: int) -> list[int]:
    """The calibration steps ``rank`` runs: a contiguous block, the first ``total % world_size`` ranks one longer.

    Fixed by the three numbers alone, so every rank (and a restarted job) computes every rank's share. Raises
    Fp8ForgeError when there are more ranks than steps (a rank with nothing to run would only wait).
    """
    if world_size > total:
        raise Fp8ForgeError(f"{world_size} ranks share {total} calibration steps: each rank needs one at least; "
                            f"start at most {total} ranks or raise calibration.steps", field="calibration.steps")
    base, longer = divmod(total, world_size)
    start = rank * base + min(rank, longer)
    return list(range(start, start + base + (1 if rank < longer else 0)))


def start_group(info: RankInfo, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Join the job's process group (NCCL where this host has a GPU, else gloo); returns the backend's name.

    A no-op returning "" for one rank of one. The rank's GPU is ``LOCAL_RANK``.
    """
    if info.world_size == 1:
        return ""
    import torch  # deferred: the rank checks above run before torch's import in a rank's start
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(info.local_rank)
    dist.init_process_group(backend, init_method=f"tcp://{info.master_addr}:{info.master_port}", rank=info.rank,
                            world_size=info.world_size, timeout=datetime.timedelta(seconds=timeout_s))
    return backend


def end_group() -> None:
    """Leave the process group, if this process joined one."""
    import torch.distributed as dist  # deferred: only a process that started a group reaches here with torch

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def every_rank(info: RankInfo, item: Any, *, group: Any = None) -> list[Any]:
    """Every rank's ``item`` in rank order, on every rank; ``group``: the process group (None: the job's)."""
    if info.world_size == 1:
        return [item]
    import torch.distributed as dist

    gathered: list[Any] = [None] * info.world_size
    dist.all_gather_object(gathered, item, group=group)
    return gathered


def from_leader(info: RankInfo, item: Any, *, group: Any = None) -> Any:
    """Rank 0's ``item``, on every rank (the others' ``item`` is ignored); ``group``: the process group (None: the
    job's)."""
    if info.world_size == 1:
        return item
    import torch.distributed as dist

    box = [item]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
