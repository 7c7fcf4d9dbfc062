"""``nvfp4_smoothing: awq`` on ranks: two ranks share the search's steps and its candidates (rank 0 folds, writes
the copy, and both calibrate on it) and publish the one-process job's bytes; a two-rank job whose rank 1 is killed
with SIGKILL once layer 1 is recorded, restarted as a resumable one-rank job (the Slurm executor's single-node job),
searches the smoothing again (the same scales), resumes calibration at layer 2 on the new copy and publishes the same
bytes; a rank that cannot read rank 0's copy stops the job with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from converters.distributed.job import DistributedJob
from converters.distributed.ranks import RankInfo
from converters.errors import Fp8ForgeError
from converters.pipeline.source_smoothing import SMOOTHED_SOURCE_DIR
from tests.converters.distributed.conftest import Job, run_one_process

pytestmark = pytest.mark.slow  # a one-process run, a killed rank and its restart

FILES = ("model.safetensors", "serving/nvfp4/model.safetensors")


@pytest.fixture(scope="module")
def smoothing_job(job) -> Job:
    """The package's model and calibration with an nvfp4 export of the smoothed model."""
    return job.with_serving("smoothing-request.json", {"backend": "ao", "nvfp4_smoothing": "awq"}, ["nvfp4"])


@pytest.fixture(scope="module")
def baseline(smoothing_job) -> Path:
    """The smoothing job run the ordinary way: one process, no record."""
    return run_one_process(smoothing_job, smoothing_job.root / "smoothing-one", timeout=240)


def test_a_job_killed_on_two_ranks_smooths_again_on_one_and_publishes_the_one_process_bytes(smoothing_job, baseline):
    """Two ranks search and calibrate layers 0 and 1 on rank 0's copy before rank 1 is killed; one rank restarts
    (a resumable one-rank job, as the Slurm executor's single-node job), searches again and resumes at layer 2."""
    out = smoothing_job.root / "smoothing-rank"
    record = smoothing_job.root / f".{out.name}.resume"
    smoothing_job.killed_after_layer_1(out, record, timeout=240)

    restarted = smoothing_job.start(1, out)
    assert restarted.wait(timeout=240) == [0], restarted.log(0)[-2000:]
    assert [name for name in FILES if (out / name).read_bytes() != (baseline / name).read_bytes()] == []
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["calibration"]["nvfp4_smoothing"]["mappings"]["smoothed"] > 0
    forward = report["calibration"]["forward"]
    assert forward["resumed_at_layer"] == 2 and forward["layers_run"] == [2, 3]
    assert not record.exists()


def test_two_ranks_share_the_search_and_publish_the_one_process_bytes(smoothing_job, baseline):
    out = smoothing_job.root / "smoothing-ranks"
    ranks = smoothing_job.start(2, out)
    assert ranks.wait(timeout=240) == [0, 0], ranks.log(0)[-2000:] + ranks.log(1)[-2000:]
    # the ranks scored the candidates on both ranks' rows (the one process's sample): the same scales, copy, export
    assert [name for name in FILES if (out / name).read_bytes() != (baseline / name).read_bytes()] == []
    report = json.loads((out / "fp8_report.json").read_text())
    expected = json.loads((baseline / "fp8_report.json").read_text())["calibration"]["nvfp4_smoothing"]
    smoothing = report["calibration"]["nvfp4_smoothing"]
    assert smoothing["mappings"] == expected["mappings"] and smoothing["mappings"]["smoothed"] > 0
    assert [{key: value for key, value in record.items() if key != "output_change"} for record in smoothing["layers"]] \
        == [{key: value for key, value in record.items() if key != "output_change"} for record in expected["layers"]]
    assert report["calibration"]["forward"]["ranks"] == 2
    assert not (out / SMOOTHED_SOURCE_DIR).exists() and not any(out.parent.glob(f".{out.name}*staging*"))


def test_a_rank_that_cannot_read_the_copy_names_itself_and_the_way_out(tmp_path):
    job = DistributedJob(info=RankInfo(), resume_dir=None)
    (tmp_path / "copy").mkdir()
    with pytest.raises(Fp8ForgeError, match=r"rank\(s\) 0 cannot read the smoothed copy .* write the job's output "
                                            r"\(--out\) there, or use nvfp4_smoothing none"):
        job.leaders_directory(tmp_path / "copy", what="the smoothed copy of the source",
                              instead="use nvfp4_smoothing none")
    (tmp_path / "copy" / "config.json").write_text("{}")
    (tmp_path / "copy" / "model.safetensors").write_bytes(b"")
    assert job.leaders_directory(tmp_path / "copy", what="", instead="") == tmp_path / "copy"
    assert job.leaders_directory(None, what="", instead="") is None
