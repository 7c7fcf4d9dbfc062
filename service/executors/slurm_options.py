"""A job's own Slurm options: the optional ``slurm`` object of a job request, over the ``slurm_*`` settings.

The request stores it beside the conversion fields (so a resubmission after a time limit asks for the same
allocation); the conversion library never sees it (:func:`conversion_fields`). Its values end up in ``#SBATCH``
lines, so each is checked against what Slurm accepts and nothing else: a value cannot carry a second directive or
a shell word into the batch script.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from service.api.recipe_schemas import json_int
from service.errors import InvalidRequest

if TYPE_CHECKING:
    from service.config import Settings
    from service.executors.slurm_cli import SlurmResources

__all__ = ["SLURM_FIELD", "SlurmCreate", "check_slurm_options", "conversion_fields", "job_resources"]

#: the request field that holds them
SLURM_FIELD = "slurm"
#: Slurm's partition and account names: letters, digits, ``_``, ``.``, ``-`` (no space, quote or newline)
_NAME = r"^[A-Za-z0-9_.\-]{1,64}$"
#: ``--time``'s formats (as ``slurm_time_limit``): minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
TIME_LIMIT = r"^(\d+-)?\d+(:\d{1,2}){0,2}$"


class SlurmCreate(BaseModel):
    """This job's Slurm allocation, field by field over the server's ``slurm_*`` settings (unset: the setting's).
    Accepted only by a server whose executor is slurm."""

    model_config = ConfigDict(extra="forbid", strict=True)
    partition: str | None = Field(None, pattern=_NAME, description="Slurm partition (as sbatch --partition).")
    account: str | None = Field(None, pattern=_NAME, description="Slurm account charged (as sbatch --account).")
    nodes: json_int(1, 4096) | None = Field(None, description="Nodes of a calibrated job's allocation (one rank "
                                                                "per GPU, or per node without GPUs); a requantize "
                                                                "job's array tasks take one slot each.")
    gpus_per_node: json_int(0, 64) | None = Field(None, description="GPUs per node (0: none).")
    time_limit: str | None = Field(None, pattern=TIME_LIMIT, max_length=32,
                                   description="Wall-time limit (minutes, MM:SS, HH:MM:SS or D-HH[:MM[:SS]]); a job "
                                               "still running at the limit is requeued and resumes in a new "
                                               "allocation.")


def check_slurm_options(request: Mapping[str, Any], settings: Settings) -> None:
    """Refuse a request's ``slurm`` object on a server that does not run jobs on Slurm. Raises InvalidRequest
    (422) naming the field and the fix."""
    if request.get(SLURM_FIELD) is not None and settings.executor != "slurm":
        raise InvalidRequest(f"this server runs jobs with the {settings.executor!r} executor, not Slurm: drop the "
                             "slurm object (it applies only where FP8FORGE_EXECUTOR=slurm)", field=SLURM_FIELD)


def conversion_fields(request: Mapping[str, Any]) -> dict[str, Any]:
    """The request less what only the executor reads: what the conversion library takes."""
    return {key: value for key, value in request.items() if key != SLURM_FIELD}


def job_resources(resources: SlurmResources, request: Mapping[str, Any], settings: Settings) -> SlurmResources:
    """``resources`` (the settings') with the request's own ``slurm`` values in their place. A job's GPUs per
    node also set its ranks per node unless ``slurm_ranks_per_node`` fixes them."""
    options = request.get(SLURM_FIELD) or {}
    changed = {name: options[name] for name in ("partition", "account", "nodes", "gpus_per_node", "time_limit")
               if options.get(name) is not None}
    if "gpus_per_node" in changed and settings.slurm_ranks_per_node is None:
        changed["ranks_per_node"] = max(1, changed["gpus_per_node"])
    return replace(resources, **changed) if changed else resources
