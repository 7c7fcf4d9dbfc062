"""GPTQ rounding (``nvfp4_weight_rounding: gptq``) in a data-parallel job: the ranks add up their steps' Hessians,
rank 0 rounds and every rank runs its steps of the rounded stream with rank 0's codes, so two ranks publish the
one-process job's NVFP4 export; the job keeps no resume record and says so."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.converters.distributed.conftest import Job, run_one_process

pytestmark = pytest.mark.slow  # starts two ranks and a one-process run

NVFP4 = "serving/nvfp4/model.safetensors"


@pytest.fixture(scope="module")
def gptq_job(job) -> Job:
    """The package's model and calibration with an nvfp4 export rounded by GPTQ."""
    request = json.loads(job.request.read_text())
    request["recipe"] = {"backend": "ao", "nvfp4_weight_scales": "four_over_six", "nvfp4_weight_rounding": "gptq"}
    request["serving_formats"] = ["nvfp4"]
    path = job.root / "gptq-request.json"
    path.write_text(json.dumps(request), encoding="utf-8")
    return Job(root=job.root, request=path)


def test_two_ranks_publish_the_one_process_gptq_export(gptq_job):
    baseline = run_one_process(gptq_job, gptq_job.root / "gptq-one", timeout=240)
    out = gptq_job.root / "gptq-ranks-2"
    ranks = gptq_job.start(2, out)
    assert ranks.wait() == [0, 0], [ranks.log(rank)[-2000:] for rank in range(2)]
    with safe_open(out / NVFP4, "pt") as ours, safe_open(baseline / NVFP4, "pt") as theirs:
        assert set(ours.keys()) == set(theirs.keys())
        packed = [key for key in ours.keys() if key.endswith("weight_packed")]
        assert len(packed) > 20  # 4 layers of 7 Linears, less layer 0's q/k/v group (q_proj: the first Linear)
        differing = [key for key in ours.keys() if not torch.equal(ours.get_tensor(key).view(torch.uint8),
                                                                   theirs.get_tensor(key).view(torch.uint8))]
    assert differing == []
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["calibration"]["nvfp4_rounding"]["weights"] == {"compressed-tensors-nvfp4": len(packed)}
    assert report["calibration"]["forward"]["ranks"] == 2
    assert any("resume record is not kept" in warning for warning in report["warnings"])
    assert not (gptq_job.root / f".{out.name}.resume").exists()
