"""A real Slurm cluster on 127.0.0.1 for the tests: munged, slurmctld and two slurmd (node1, node2: two nodes'
worth of slots on this one machine) from Debian's slurm-wlm 22.05, with a generated slurm.conf in a temp dir.

No scheduler is mocked: the service's ``sbatch``/``squeue``/``scancel`` reach this controller through
``SLURM_CONF``, and its jobs run in slurmstepd on these nodes. slurmd runs jobs as their user, so it needs root
(the CI machines run the tests as root); without the packages or root the tests skip and say what is missing.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.service_helpers import free_port, is_fork_server_child, wait_for

__all__ = ["SlurmCluster", "conversion_pids", "pause_conversion", "pause_conversion_when", "rank_pids", "slurm_missing"]

NODES = ("node1", "node2")
CPUS_PER_NODE = 2
_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo")


def first_job_id(environ: dict[str, str] | os._Environ[str] = os.environ) -> int:
    """The first job id of this process's cluster: each xdist process starts its own cluster, and the processes are
    found by their ``SLURM_JOB_ID`` (:func:`conversion_pids`), so two clusters numbering their jobs alike let one
    test stop (SIGSTOP) another's conversion, and see it end under its hand."""
    worker = environ.get("PYTEST_XDIST_WORKER", "")
    return 1 + 100_000 * (int(worker[2:]) + 1) if worker.startswith("gw") and worker[2:].isdigit() else 1


def conversion_pids(slurm_job: str) -> list[int]:
    """The processes of Slurm job ``slurm_job`` that its ranks started to convert: rank 0's is a fork of its fork
    server (``service.workers.task_server``), another rank's is spawned (multiprocessing's spawn_main). Job ids are
    unique across the test processes' clusters (:func:`first_job_id`)."""
    variable = f"\0SLURM_JOB_ID={slurm_job}\0".encode()
    return _pids(lambda proc, argv: (any(b"spawn_main" in arg for arg in argv) or is_fork_server_child(int(proc.name)))
                 and variable in b"\0" + (proc / "environ").read_bytes())


def rank_pids(job_id: str) -> list[int]:
    """The rank processes of service job ``job_id`` (``python -m service.executors.slurm_rank ... JOB_ID``), not
    srun's."""
    return _pids(lambda proc, argv: b"service.executors.slurm_rank" in argv and job_id.encode() in argv
                 and b"srun" not in argv[0])


def _pids(matches: Callable[[Path, list[bytes]], bool]) -> list[int]:
    """The processes for which ``matches(/proc/PID, argv)`` is true; one that ends meanwhile is left out."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if matches(proc, (proc / "cmdline").read_bytes().split(b"\0")):
                found.append(int(proc.name))
        except OSError:  # a process that has ended, or one whose files are not ours to read
            continue
    return found


def pause_conversion(slurm_job: str) -> None:
    """SIGSTOP the conversion processes of Slurm job ``slurm_job`` (found within 30 s), so that its allocation
    outlives a time limit on any CPU; its rank goes on heartbeating, and slurmd sends SIGCONT before SIGTERM when it
    ends the job."""
    frozen = wait_for(lambda: conversion_pids(slurm_job), timeout=30, what=f"job {slurm_job}'s conversion process")
    _signal(frozen, signal.SIGSTOP)


def pause_conversion_when(slurm_job: str, done: Callable[[], bool], *, timeout: float = 600, slice_s: float = 0.1,
                          context: Callable[[], str] = str) -> None:
    """Run the conversion processes of Slurm job ``slurm_job`` in slices of ``slice_s`` seconds, stopped (SIGSTOP)
    between them, until ``done()`` holds, and leave them stopped there: at most a slice past the point ``done``
    names, whatever the CPU and its load (a poll for it and a SIGSTOP after it let a fast CPU run on past it). Its
    rank goes on heartbeating, and slurmd sends SIGCONT before SIGTERM when it ends the job. ``context``: what a
    failure message shows (the server's log)."""
    frozen = wait_for(lambda: conversion_pids(slurm_job), timeout=timeout, interval=0.05,
                      what=f"job {slurm_job}'s conversion process")
    deadline = time.monotonic() + timeout
    try:
        _signal(frozen, signal.SIGSTOP)
        while not done():
            assert time.monotonic() < deadline, f"job {slurm_job}'s conversion did not get there in {timeout} s"
            _signal(frozen, signal.SIGCONT)
            time.sleep(slice_s)
            _signal(frozen, signal.SIGSTOP)
    except ProcessLookupError as error:  # the conversion ended: only done() says whether that is what was waited for
        if not done():
            raise AssertionError(f"job {slurm_job}'s conversion ended first: {error}\n{context()}") from error
    except AssertionError as error:
        raise AssertionError(f"{error}\n{context()}") from error


def _signal(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        os.kill(pid, sig)


def slurm_missing() -> str | None:
    """Why this machine cannot run the test cluster; None when it can."""
    missing = [name for name in _BINARIES if shutil.which(name) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} not on PATH): apt-get install slurm-wlm munge "
                "(Debian's slurm-wlm 22.05; `make slurm` does it)")
    if os.geteuid() != 0:
        return "slurmd runs jobs as their user and needs root: run the Slurm executor tests as root"
    return None


class SlurmCluster:
    """Start with :meth:`start`, end with :meth:`stop`; ``env`` is what a client of this cluster needs."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen[bytes]] = []

    def _write_conf(self) -> None:
        root, ctld_port = self.root, free_port()
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        nodes = "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
                          f"CPUs={CPUS_PER_NODE} State=UNKNOWN" for name in NODES)
        self.conf.write_text(f"""\
ClusterName=fp8forgetest
FirstJobId={first_job_id()}
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root / 'munge.sock'}
CredType=cred/munge
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool-%n'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd-%n.pid'}
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
KillWait=5
MinJobAge=600
InactiveLimit=0
{nodes}
PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
""")
        (root / "state").mkdir()

    def start(self) -> SlurmCluster:
        self._write_conf()
        root = self.root
        self._spawn("munged", ["munged", "-F", "-f", f"--key-file={root / 'munge.key'}",
                               f"--socket={root / 'munge.sock'}", f"--pid-file={root / 'munged.pid'}",
                               f"--seed-file={root / 'munged.seed'}"])
        self._wait(lambda: (root / "munge.sock").exists(), "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for name in NODES:
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-f", str(self.conf), "-N", name])
        self._wait(self._nodes_idle, "both nodes idle in sinfo")
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        with (self.root / f"{name}.out").open("ab") as log:
            self._procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                                env={**os.environ, **self.env}))

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "--noheader", "--Node", "--format=%N %T", check=False)
        states = dict(line.split() for line in out.splitlines() if line.strip())
        return all(states.get(name) == "idle" for name in NODES)

    def _wait(self, predicate, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [p.args[0] for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}"
                                 for p in sorted(self.root.glob("*.out")) + sorted(self.root.glob("*.log")))
                raise AssertionError(f"the test Slurm cluster did not start ({what}; exited: {dead})\n{logs}")
            time.sleep(0.2)

    def run(self, *argv: str, check: bool = True) -> str:
        """Run a Slurm client against this cluster; returns its stdout."""
        done = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **self.env}, timeout=60,
                              check=False)
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed: {done.stderr}")
        return done.stdout

    def job_field(self, slurm_id: str, field: str) -> str:
        """One field of ``scontrol show job`` (JobState, ExitCode, ...); an array's first task for an array."""
        out = self.run("scontrol", "show", "job", slurm_id, "--oneliner")
        for token in out.split():
            if token.startswith(f"{field}="):
                return token.split("=", 1)[1]
        raise AssertionError(f"scontrol shows no {field} for job {slurm_id}: {out}")

    def job_states(self, slurm_id: str) -> list[str]:
        """JobState of the job, or of every task of an array."""
        out = self.run("scontrol", "show", "job", slurm_id, "--oneliner")
        return [token.split("=", 1)[1] for token in out.split() if token.startswith("JobState=")]

    def end_by_time_limit(self, slurm_job: str) -> None:
        """Lower running job ``slurm_job``'s time limit to zero: slurmctld ends it as it ends any job past its limit
        (state TIMEOUT; slurmd's SIGCONT, SIGTERM, then SIGKILL after KillWait) at its next periodic check, within
        30 s. A limit of one minute, the shortest sbatch takes, would keep it 60-90 s."""
        self.run("scontrol", "update", f"JobId={slurm_job}", "TimeLimit=0")
        assert self.job_field(slurm_job, "TimeLimit") == "00:00:00", "scontrol did not lower the time limit to zero"

    def stop(self) -> None:
        self.run("scancel", "--me", check=False)  # this cluster's jobs only: SLURM_CONF names it
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
        for proc in reversed(self._procs):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
