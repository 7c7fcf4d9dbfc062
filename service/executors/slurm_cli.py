"""Slurm's command-line clients (``sbatch``, ``squeue``, ``scancel``) and the batch scripts the executor submits.

The service talks to Slurm the way a user does: through its clients, with ``SLURM_CONF`` (or the host's
``/etc/slurm/slurm.conf``) naming the cluster. No Slurm library is linked; a site's plugins and wrappers
(``sbatch`` lua filters, QOS) apply as they do to its users' jobs.

Each Slurm job is named ``fp8forge-<job id>``: ``squeue`` alone then tells which jobs of the store have an
allocation, pending or running, without the store keeping Slurm's ids.
"""

from __future__ import annotations

import logging
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from service.config import Settings

__all__ = ["NAME_PREFIX", "SlurmCli", "SlurmError", "SlurmJob", "SlurmResources", "array_script", "calibrated_script"]

logger = logging.getLogger(__name__)

NAME_PREFIX = "fp8forge-"
# MASTER_PORT is derived from the Slurm job id, so two jobs sharing a first node do not collide; this range stays
# clear of the ephemeral ports (32768 and up on Linux) and of the well-known ones.
_PORT_BASE, _PORT_SPAN = 20_000, 10_000


class SlurmError(RuntimeError):
    """A Slurm client is missing or refused a command; the message says which and what it printed."""


@dataclass(frozen=True)
class SlurmJob:
    """A Slurm job of this service as ``squeue`` lists it."""

    slurm_id: str  # the job id; for an array, the array's own id (``%F``)
    job_id: str  # the store's job it runs
    state: str  # PENDING, RUNNING, COMPLETING, ...


@dataclass(frozen=True)
class SlurmResources:
    """What each Slurm job asks for, from the ``slurm_*`` settings."""

    partition: str = ""
    account: str = ""
    nodes: int = 1
    gpus_per_node: int = 0
    ranks_per_node: int = 1
    cpus_per_rank: int | None = None
    time_limit: str = ""
    array_tasks: int = 4

    @classmethod
    def from_settings(cls, settings: Settings) -> SlurmResources:
        ranks = settings.slurm_ranks_per_node or max(1, settings.slurm_gpus_per_node)
        return cls(partition=settings.slurm_partition, account=settings.slurm_account, nodes=settings.slurm_nodes,
                   gpus_per_node=settings.slurm_gpus_per_node, ranks_per_node=ranks,
                   cpus_per_rank=settings.slurm_cpus_per_rank, time_limit=settings.slurm_time_limit,
                   array_tasks=settings.slurm_array_tasks)

    def directives(self) -> list[str]:
        """The ``#SBATCH`` lines every job of the service carries."""
        lines = [f"--{name}={value}" for name, value in (
            ("partition", self.partition), ("account", self.account), ("time", self.time_limit),
            ("cpus-per-task", self.cpus_per_rank or ""), ("gpus-per-node", self.gpus_per_node or "")) if value]
        # the service requeues a job whose allocation ended (its store row goes back to queued) and submits it
        # again; Slurm's own requeue would start a second allocation for the same attempt
        return ["--no-requeue", *lines]


def calibrated_script(job_id: str, resources: SlurmResources, *, python: str, settings_file: Path,
                      output_dir: Path) -> str:
    """The batch script of a calibrated job: ``srun`` starts one rank per slot, each with the standard
    torch.distributed variables (``service.executors.slurm_rank`` derives RANK, WORLD_SIZE and LOCAL_RANK from
    Slurm's; the script the rendezvous: the address of the allocation's first node, a port from the job id)."""
    directives = [f"--job-name={NAME_PREFIX}{job_id}", f"--output={output_dir / 'slurm-%j.out'}",
                  f"--nodes={resources.nodes}", f"--ntasks-per-node={resources.ranks_per_node}",
                  *resources.directives()]
    rank = [python, "-m", "service.executors.slurm_rank", "calibrated", "--settings", str(settings_file), job_id]
    return "\n".join([
        "#!/bin/bash",
        *(f"#SBATCH {line}" for line in directives),
        "set -euo pipefail",
        'first_node="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        # the address Slurm itself reaches that node at: a node's name need not resolve (several slurmd on a host)
        'MASTER_ADDR="$(scontrol show node "$first_node" --oneliner | sed -n \'s/.*NodeAddr=\\([^ ]*\\).*/\\1/p\')"',
        'MASTER_ADDR="${MASTER_ADDR:-$first_node}"',
        f"MASTER_PORT=$(( {_PORT_BASE} + SLURM_JOB_ID % {_PORT_SPAN} ))",
        "export MASTER_ADDR MASTER_PORT",
        # one rank that dies ends the step: the others would wait for it in their next collective forever
        f"srun --kill-on-bad-exit=1 {shlex.join(rank)}",
        "",
    ])


def array_script(job_id: str, resources: SlurmResources, *, python: str, settings_file: Path,
                 output_dir: Path) -> str:
    """The batch script of a requantize job: an array of ``array_tasks`` one-slot tasks, each a worker that claims
    the job's shard tasks until none is left."""
    directives = [f"--job-name={NAME_PREFIX}{job_id}", f"--output={output_dir / 'slurm-%A_%a.out'}",
                  f"--array=0-{resources.array_tasks - 1}", "--ntasks=1", *resources.directives()]
    worker = [python, "-m", "service.executors.slurm_rank", "tasks", "--settings", str(settings_file), job_id]
    return "\n".join(["#!/bin/bash", *(f"#SBATCH {line}" for line in directives), f"exec {shlex.join(worker)}", ""])


class SlurmCli:
    """Runs Slurm's clients; each call waits at most ``timeout_s`` (a controller that does not answer is an error
    the caller retries, not a hang)."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s

    def submit(self, script: str) -> str:
        """``sbatch`` the script (read from stdin); returns the Slurm job id."""
        out = self._run(["sbatch", "--parsable"], stdin=script)
        slurm_id = out.strip().split(";")[0]  # "<id>" or "<id>;<cluster>"
        if not slurm_id.isdigit():
            raise SlurmError(f"sbatch answered {out.strip()!r} instead of a job id")
        return slurm_id

    def jobs(self) -> list[SlurmJob]:
        """This user's Slurm jobs of the service that are not finished (pending, running, completing...)."""
        out = self._run(["squeue", "--me", "--noheader", "--format=%F|%j|%T"])
        found = []
        for line in out.splitlines():
            slurm_id, name, state = (line.split("|") + ["", "", ""])[:3]
            if name.startswith(NAME_PREFIX):
                found.append(SlurmJob(slurm_id.strip(), name[len(NAME_PREFIX):], state.strip()))
        return found

    def cancel(self, slurm_id: str) -> None:
        """``scancel`` the job (every step and array task of it)."""
        self._run(["scancel", slurm_id])

    def _run(self, argv: list[str], *, stdin: str | None = None) -> str:
        if shutil.which(argv[0]) is None:
            raise SlurmError(f"{argv[0]} is not on PATH: FP8FORGE_EXECUTOR=slurm needs Slurm's clients on the service "
                             "host (Debian/Ubuntu: apt-get install slurm-client) and SLURM_CONF naming the cluster")
        try:
            done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=self.timeout_s,
                                  check=False)
        except subprocess.TimeoutExpired as exc:
            raise SlurmError(f"{argv[0]} did not answer within {self.timeout_s:g}s (is slurmctld up?)") from exc
        if done.returncode != 0:
            raise SlurmError(f"{shlex.join(argv)} failed with code {done.returncode}: "
                             f"{(done.stderr or done.stdout).strip()[-2000:]}")
        return done.stdout
