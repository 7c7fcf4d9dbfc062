"""GPTQ rounding (``nvfp4_weight_rounding: gptq``) in a data-parallel job: the ranks add up their steps' Hessians,
rank 0 rounds and every rank runs its steps of the rounded stream with rank 0's codes; the resume record keeps each
layer's rounded stream and weights, so a job whose rank was killed part-way resumes on another number of ranks and
publishes the one-process job's NVFP4 export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from tests.converters.distributed.conftest import STEPS, Job, run_one_process

pytestmark = pytest.mark.slow  # starts two ranks and a one-process run

NVFP4 = "serving/nvfp4/model.safetensors"
FAMILY = "compressed-tensors-nvfp4"  #: the nvfp4 export's rounding family


@pytest.fixture(scope="module")
def gptq_job(job) -> Job:
    """The package's model and calibration with an nvfp4 export rounded by GPTQ."""
    return job.with_serving("gptq-request.json", {"backend": "ao", "nvfp4_weight_scales": "four_over_six",
                                                  "nvfp4_weight_rounding": "gptq"}, ["nvfp4"])


def test_a_killed_gptq_job_resumes_on_other_ranks_and_publishes_the_one_process_export(gptq_job):
    baseline = run_one_process(gptq_job, gptq_job.root / "gptq-one", timeout=240)
    out = gptq_job.root / "gptq-ranks"
    record = gptq_job.root / f".{out.name}.resume"
    gptq_job.killed_after_layer_1(out, record)
    assert sorted(path.name for path in (record / "rounded").iterdir()) == \
        [f"layer-{index:05d}-{FAMILY}.safetensors" for index in range(2)]
    assert len(list((record / "hidden").glob(f"layer-1-step-*-{FAMILY}.safetensors"))) == STEPS

    restarted = gptq_job.start(3, out)
    assert restarted.wait(timeout=600) == [0, 0, 0], restarted.log(0)[-2000:]
    with safe_open(out / NVFP4, "pt") as ours, safe_open(baseline / NVFP4, "pt") as theirs:
        assert set(ours.keys()) == set(theirs.keys())
        packed = [key for key in ours.keys() if key.endswith("weight_packed")]
        assert len(packed) > 20  # 4 layers of 7 Linears, less layer 0's q/k/v group (q_proj: the first Linear)
        differing = [key for key in ours.keys() if not torch.equal(ours.get_tensor(key).view(torch.uint8),
                                                                   theirs.get_tensor(key).view(torch.uint8))]
    assert differing == []
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["calibration"]["nvfp4_rounding"]["weights"] == {FAMILY: len(packed)}
    forward = report["calibration"]["forward"]
    assert forward["ranks"] == 3 and forward["resumed_at_layer"] == 2 and forward["layers_run"] == [2, 3]
    assert not record.exists()


def test_a_moe_gptq_job_on_two_ranks_publishes_the_one_process_export(gptq_job):
    """Each expert's Hessians are the sum of what every rank routed to it (a rank may route it none), so two ranks
    round every expert matrix as one process does."""
    from tests.models import save_tiny_moe

    save_tiny_moe("qwen2_moe", gptq_job.root / "qwen2_moe")
    request = json.loads(gptq_job.request.read_text())
    request["model"] = str(gptq_job.root / "qwen2_moe")
    moe = gptq_job.with_request("gptq-moe-request.json", request)
    baseline = run_one_process(moe, moe.root / "gptq-moe-one", timeout=240)
    out = moe.root / "gptq-moe-ranks"
    ranks = moe.start(2, out)
    assert ranks.wait(timeout=600) == [0, 0], ranks.log(0)[-2000:]
    with safe_open(out / NVFP4, "pt") as ours, safe_open(baseline / NVFP4, "pt") as theirs:
        assert set(ours.keys()) == set(theirs.keys())
        experts = [key for key in ours.keys() if ".experts." in key and key.endswith("weight_packed")]
        assert experts
        differing = [key for key in ours.keys() if not torch.equal(ours.get_tensor(key).view(torch.uint8),
                                                                   theirs.get_tensor(key).view(torch.uint8))]
    assert differing == []
    rounded = json.loads((out / "fp8_report.json").read_text())["calibration"]["nvfp4_rounding"]["weights"][FAMILY]
    assert rounded >= len(experts)
