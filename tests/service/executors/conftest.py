"""The session's real Slurm cluster (``slurm_cluster.SlurmCluster``), started once for the executor tests."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.service.executors.slurm_cluster import SlurmCluster, slurm_missing


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = slurm_missing()
    if reason is not None:
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = cluster.env["SLURM_CONF"]  # Slurm's clients, this process's and its children's
    try:
        yield cluster
    finally:
        cluster.stop()
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
