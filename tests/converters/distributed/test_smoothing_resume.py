"""``nvfp4_smoothing: awq`` in a resumable one-rank job (the Slurm executor's single-node job): killed with SIGKILL
once layer 1 is recorded, the restart searches the smoothing again (the same scales), resumes calibration at layer 2
on the smoothed copy and publishes the one-process job's bytes; several ranks are refused naming the field."""

from __future__ import annotations

import json
import signal

import pytest

from tests.converters.distributed.conftest import Job, run_one_process

pytestmark = pytest.mark.slow  # a one-process run, a killed rank and its restart

FILES = ("model.safetensors", "serving/nvfp4/model.safetensors")


@pytest.fixture(scope="module")
def smoothing_job(job) -> Job:
    """The package's model and calibration with an nvfp4 export of the smoothed model."""
    return job.with_serving("smoothing-request.json", {"backend": "ao", "nvfp4_smoothing": "awq"}, ["nvfp4"])


def test_a_killed_one_rank_job_smooths_again_resumes_and_publishes_the_one_process_bytes(smoothing_job):
    baseline = run_one_process(smoothing_job, smoothing_job.root / "smoothing-one", timeout=240)
    out = smoothing_job.root / "smoothing-rank"
    record = smoothing_job.root / f".{out.name}.resume"
    killed = smoothing_job.start(1, out, script=["tests/converters/distributed/killed_rank.py"],
                                 extra_env={"KILL_AFTER_LAYER": "1"})
    assert killed.wait(timeout=240) == [-signal.SIGKILL], killed.log(0)[-2000:]
    assert sorted(path.name for path in record.glob("layer-*.safetensors")) == \
        ["layer-0.safetensors", "layer-1.safetensors"]

    restarted = smoothing_job.start(1, out)
    assert restarted.wait(timeout=240) == [0], restarted.log(0)[-2000:]
    assert [name for name in FILES if (out / name).read_bytes() != (baseline / name).read_bytes()] == []
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["calibration"]["nvfp4_smoothing"]["mappings"]["smoothed"] > 0
    forward = report["calibration"]["forward"]
    assert forward["resumed_at_layer"] == 2 and forward["layers_run"] == [2, 3]
    assert not record.exists()


def test_a_job_on_two_ranks_is_refused_naming_the_field(smoothing_job):
    out = smoothing_job.root / "smoothing-ranks"
    ranks = smoothing_job.start(2, out)
    codes = ranks.wait(timeout=240)
    assert codes != [0, 0]
    assert "nvfp4_smoothing awq is not available to jobs on several ranks yet" in ranks.log(0)
    assert not out.exists()
