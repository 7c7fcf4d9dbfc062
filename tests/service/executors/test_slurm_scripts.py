"""The executor's batch scripts, as the real sbatch of the test cluster reads them, and its settings."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from service.config import SettingsError, load_settings
from service.executors.slurm_cli import SlurmCli, SlurmError, SlurmResources, array_script, calibrated_script
from tests.service.executors.slurm_cluster import SlurmCluster


def test_a_calibrated_job_runs_one_rank_per_slot_with_the_torch_distributed_variables(
        slurm: SlurmCluster, tmp_path: Path) -> None:
    """Two nodes, two ranks each: every rank learns RANK / WORLD_SIZE / LOCAL_RANK from srun and the same
    rendezvous, the first node's address and a port from the job id."""
    script = calibrated_script("0" * 32, SlurmResources(nodes=2, ranks_per_node=2), python="python3",
                               settings_file=tmp_path / "settings.json", output_dir=tmp_path)
    probe = ("import os; from service.executors.slurm_rank import rendezvous_from_slurm as r; v = r(); "
             "print(v['RANK'], v['WORLD_SIZE'], v['LOCAL_RANK'], v['MASTER_ADDR'], v['MASTER_PORT'], "
             "os.environ['SLURMD_NODENAME'])")
    rank_line = script.splitlines()[-1]
    script = script.replace(rank_line, f"srun --kill-on-bad-exit=1 {sys.executable} -c \"{probe}\"")
    slurm_id = SlurmCli().submit(script)
    _wait_done(slurm, slurm_id)
    lines = sorted((tmp_path / f"slurm-{slurm_id}.out").read_text().split("\n"))
    ranks = [line.split() for line in lines if line.strip()]
    port = str(20_000 + int(slurm_id) % 10_000)
    assert ranks == [["0", "4", "0", "127.0.0.1", port, "node1"], ["1", "4", "1", "127.0.0.1", port, "node1"],
                     ["2", "4", "0", "127.0.0.1", port, "node2"], ["3", "4", "1", "127.0.0.1", port, "node2"]]


def test_sbatch_accepts_the_array_script_and_squeue_names_its_job(slurm: SlurmCluster, tmp_path: Path) -> None:
    script = array_script("f" * 32, SlurmResources(array_tasks=3, time_limit="5"), python="true",
                          settings_file=tmp_path / "settings.json", output_dir=tmp_path)
    # a partition that is down takes jobs and starts none: the array stays pending
    slurm.run("scontrol", "update", "PartitionName=debug", "State=DOWN")
    try:
        slurm_id = SlurmCli().submit(script)
        listed = [job for job in SlurmCli().jobs() if job.slurm_id == slurm_id]
        assert [(job.job_id, job.state) for job in listed] == [("f" * 32, "PENDING")]
        SlurmCli().cancel(slurm_id)
        assert not [job for job in SlurmCli().jobs() if job.slurm_id == slurm_id]
    finally:
        slurm.run("scontrol", "update", "PartitionName=debug", "State=UP")
    assert set(slurm.job_states(slurm_id)) == {"CANCELLED"}
    assert slurm.job_field(slurm_id, "TimeLimit") == "00:05:00"


def test_a_refused_submission_says_what_slurm_said(slurm: SlurmCluster, tmp_path: Path) -> None:
    script = calibrated_script("a" * 32, SlurmResources(partition="no-such-partition"), python="true",
                               settings_file=tmp_path / "s.json", output_dir=tmp_path)
    with pytest.raises(SlurmError, match="invalid partition"):
        SlurmCli().submit(script)


def test_bad_slurm_settings_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FP8FORGE_SLURM_TIME_LIMIT", "two hours")
    with pytest.raises(SettingsError, match="FP8FORGE_SLURM_TIME_LIMIT"):
        load_settings()
    monkeypatch.setenv("FP8FORGE_SLURM_TIME_LIMIT", "1-12:00:00")
    monkeypatch.setenv("FP8FORGE_EXECUTOR", "kubernetes")
    with pytest.raises(SettingsError, match="FP8FORGE_EXECUTOR.*'local' or 'slurm'"):
        load_settings()


def _wait_done(slurm: SlurmCluster, slurm_id: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while set(slurm.job_states(slurm_id)) - {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}:
        assert time.monotonic() < deadline, f"Slurm job {slurm_id} still {slurm.job_states(slurm_id)}"
        time.sleep(0.5)


def test_a_service_host_without_slurm_clients_is_told_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch there
    with pytest.raises(SlurmError, match=r"sbatch is not on PATH.*apt-get install slurm-client.*SLURM_CONF"):
        SlurmCli().submit("#!/bin/bash\ntrue\n")
