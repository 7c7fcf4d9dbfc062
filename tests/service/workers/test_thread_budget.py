"""The conversion child's CPU thread budget: ``conversion_threads``, else every usable CPU but one.

The end-to-end tests run a real job through the real worker, whose spawned child runs the real ``child_main``
(a real conversion of a tiny Llama) and then reports the thread counts torch ran with.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from service.config import Settings
from service.jobs import JobStatus
from service.workers import child as child_module
from service.workers.child import cpu_quota, thread_budget, usable_cpus
from service.workers.worker import Worker
from tests.models import save_tiny_model

pytestmark = pytest.mark.slow  # spawns processes or servers: seconds each


def report_after_child(request: dict[str, Any], out_dir: str, sources: dict[str, Any], conn: Any, stop: Any,
                       worker_pid: int, **kwargs: Any) -> None:
    """Runs the real ``child_main``, writing what torch runs with next to the data dir's jobs/ as soon as the child
    has set its threads (before the job's result reaches the parent, which may end the child once it has it)."""
    limit_threads = child_module.limit_threads

    def limit_and_record(configured: Any) -> int:
        threads = limit_threads(configured)
        import torch

        seen = {"intra": torch.get_num_threads(), "interop": torch.get_num_interop_threads(),
                "env": {name: os.environ.get(name)
                        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY")}}
        (Path(out_dir).parents[1] / "threads.json").write_text(json.dumps(seen))
        return threads

    child_module.limit_threads = limit_and_record  # this child process's module only
    child_module.child_main(request, out_dir, sources, conn, stop, worker_pid, **kwargs)


@pytest.mark.parametrize("configured", [3, None], ids=["configured", "default"])
def test_the_conversion_child_runs_with_the_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   configured: int | None) -> None:
    monkeypatch.setattr("service.workers.runner.child_main", report_after_child)
    model = save_tiny_model("llama", tmp_path / "models" / "llama")
    settings = Settings(data_dir=tmp_path / "data", allowed_model_roots=(model.parent,), hf_offline=True,
                        conversion_threads=configured)
    worker = Worker(settings)
    try:
        job, _ = worker.store.create_job(
            {"model": str(model), "recipe": {"backend": "ao"},
             "calibration": {"steps": 2, "batch_size": 1, "seq_len": 8}}, request_hash="threads")
        assert worker.run_once() is True
        done = worker.store.get_job(job.id)
    finally:
        worker.store.close()
    assert done.status is JobStatus.SUCCEEDED, (done.error_code, done.error_message)
    expected = configured if configured is not None else max(1, len(os.sched_getaffinity(0)) - 1)
    seen = json.loads((settings.data_dir / "threads.json").read_text())
    assert seen == {"intra": expected, "interop": expected,
                    "env": {"OMP_NUM_THREADS": str(expected), "MKL_NUM_THREADS": str(expected),
                            # threads wait passively unless the operator chose otherwise
                            "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE")}}


@pytest.mark.parametrize(("configured", "cpus", "budget"), [
    (None, 1, 1),    # never zero
    (None, 2, 1),
    (None, 16, 15),  # one core stays with the API
    (4, 16, 4),      # the setting wins
    (8, 2, 8),       # even above the cores: the operator asked for it
])
def test_budget_is_the_setting_else_all_cpus_but_one(configured: int | None, cpus: int, budget: int) -> None:
    assert thread_budget(configured, cpus) == budget


@pytest.mark.parametrize(("configured", "cpus", "conversions", "budget"), [
    (None, 16, 3, 5),  # 15 cores the API leaves, shared by three conversions
    (None, 16, 1, 15),
    (None, 2, 4, 1),   # never zero
    (6, 16, 3, 6),     # the setting wins
])
def test_local_workers_share_the_budget(configured: int | None, cpus: int, conversions: int, budget: int) -> None:
    assert thread_budget(configured, cpus, conversions=conversions) == budget


def test_a_pool_of_several_workers_hands_each_its_share(tmp_path) -> None:
    from service.config import Settings
    from service.workers.pool import WorkerPool

    shared = WorkerPool(Settings(data_dir=tmp_path), 3).settings.conversion_threads
    assert shared == max(1, (usable_cpus() - 1) // 3)
    assert WorkerPool(Settings(data_dir=tmp_path), 1).settings.conversion_threads is None  # the child decides
    assert WorkerPool(Settings(data_dir=tmp_path, conversion_threads=7), 3).settings.conversion_threads == 7


@pytest.mark.parametrize(("files", "quota"), [
    ({}, None),
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "200000 100000\n"}, 2.0),
    ({"cpu.max": "150000 100000\n"}, 1.5),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),  # cgroup v1, no limit
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3.0),
], ids=["none", "v2-unlimited", "v2-2cpus", "v2-1.5cpus", "v1-unlimited", "v1-3cpus"])
def test_a_cgroup_cpu_limit_is_read(tmp_path: Path, files: dict[str, str], quota: float | None) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(tmp_path) == quota


def test_usable_cpus_are_the_affinity_capped_by_the_cgroup_limit(tmp_path: Path) -> None:
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path) == affinity  # no limit there
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU still runs one thread
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{(affinity + 4) * 100000} 100000\n")  # a limit above the mask
    assert usable_cpus(tmp_path) == affinity
