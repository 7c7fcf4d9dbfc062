"""What a plan chooses among: precisions per GPU, bytes per format, the units (fused groups), the request field."""

from __future__ import annotations

from pathlib import Path

import pytest

from converters.errors import RequestError
from converters.model.sources import ModelSourceOptions
from converters.pipeline.request import ConversionRequest
from converters.plan.candidates import decision_units, plan_compare_recipes, precisions_for, weight_bytes
from converters.plan.settings import PlanSettings


@pytest.mark.parametrize(("gpu", "runs"), [
    ("h100", ["fp8-current", "fp8-block"]),  # Hopper: no MXFP8 or NVFP4
    ("l40s", ["fp8-current"]),  # Ada: block scaling needs 9.0
    ("b200", ["fp8-current", "fp8-block", "mxfp8", "nvfp4"]),
    ("rtx-pro-6000", ["fp8-current", "fp8-block", "nvfp4"]),  # 12.0: TE does not run MXFP8 there yet
    ("a100", []),
])
def test_each_gpu_runs_the_recipes_its_capability_allows(gpu, runs):
    chosen, out = precisions_for(gpu)
    assert chosen == runs
    assert set(out) == {"fp8-current", "fp8-block", "mxfp8", "nvfp4"} - set(runs)


def test_weight_bytes_count_each_format_and_its_scales():
    assert weight_bytes("bf16", 256, 128) == 2 * 256 * 128
    assert weight_bytes("fp8-current", 256, 128) == 256 * 128 + 4
    assert weight_bytes("fp8-block", 256, 130) == 256 * 130 + 4 * 2 * 2  # partial blocks count whole
    assert weight_bytes("mxfp8", 256, 128) == 256 * 128 + 256 * 128 // 32
    assert weight_bytes("nvfp4", 256, 128) == 256 * 128 // 2 + 256 * 128 // 16 + 4


def test_fused_groups_are_one_unit_and_a_partly_eligible_group_stays_bf16(tmp_path):
    from converters.api import analyze

    report = analyze("demo/tiny-llama", sources=ModelSourceOptions(demo_dir=tmp_path / "demo"))
    units, kept = decision_units(report)
    by_name = {unit.name: unit for unit in units}
    assert by_name["model.layers.1.self_attn.qkv"].members == tuple(
        f"model.layers.1.self_attn.{p}_proj" for p in "qkv")
    assert by_name["model.layers.1.mlp.gate_up"].members == ("model.layers.1.mlp.gate_proj",
                                                              "model.layers.1.mlp.up_proj")
    # layer 0's q_proj is the first Linear: its whole q/k/v GEMM stays bf16
    assert kept["model.layers.0.self_attn.q_proj"] == "not eligible: first_linear"
    assert "only partly eligible" in kept["model.layers.0.self_attn.k_proj"]
    assert "model.layers.0.self_attn.qkv" not in by_name
    # k/v are 128 -> 64: whole 128x128 blocks and NVFP4's 128 rule do not fit, MXFP8's 32 does
    qkv = by_name["model.layers.1.self_attn.qkv"]
    assert [qkv.fits(p) for p in ("fp8-current", "fp8-block", "mxfp8", "nvfp4")] == [True, False, True, False]


@pytest.mark.parametrize(("plan", "field"), [
    ({}, "plan"),
    ({"target_kl": 0.01, "min_sqnr_db": 20}, "plan"),
    ({"target_kl": -1}, "plan.target_kl"),
    ({"target_kl": float("nan")}, "plan.target_kl"),
    ({"max_ppl_increase": True}, "plan.max_ppl_increase"),
    ({"target_kl": 0.01, "gpu": "h800"}, "plan.gpu"),
    ({"target_kl": 0.01, "objective": "speed"}, "plan.objective"),
    ({"target_kl": 0.01, "budget": 1}, "plan.budget"),
    ("fast", "plan"),
])
def test_a_bad_plan_is_refused_naming_its_field(plan, field):
    with pytest.raises(RequestError) as caught:
        ConversionRequest.from_dict({"model": "demo/tiny-llama", "plan": plan})
    assert caught.value.field == field


def test_the_request_keeps_the_plan_and_its_candidates_are_compared():
    request = ConversionRequest.from_dict({"model": "demo/tiny-llama", "plan": {"min_sqnr_db": 25, "gpu": "h200"}})
    assert request.to_dict()["plan"] == {"min_sqnr_db": 25.0, "objective": "memory", "gpu": "h200"}
    assert plan_compare_recipes(request.plan, ("te-delayed",)) == ("te-delayed", "te-current", "te-float8-block")
    assert plan_compare_recipes(None, ("te-delayed",)) == ("te-delayed",)
    with pytest.raises(RequestError) as caught:
        ConversionRequest.from_dict({"model": "demo/tiny-llama", "plan": {"target_kl": 0.1}, "measure": False})
    assert caught.value.field == "measure"
    assert PlanSettings.from_dict({"max_ppl_increase": 0.5}).target == ("max_ppl_increase", 0.5)


def test_the_api_schema_takes_the_plan():
    from pydantic import ValidationError

    from service.api.schemas import JobCreate

    body = JobCreate.model_validate({"model": "demo/tiny-llama", "plan": {"target_kl": 0.01, "gpu": "b200"}})
    assert ConversionRequest.from_dict(body.to_request()).plan == {"target_kl": 0.01, "objective": "memory",
                                                                    "gpu": "b200"}
    with pytest.raises(ValidationError):
        JobCreate.model_validate({"model": "demo/tiny-llama", "plan": {"target_kl": 0.01, "gpu": "tpu"}})


def test_plan_settings_module_is_torch_free():
    import subprocess
    import sys

    code = ("import sys; import converters.plan.settings, converters.pipeline.request; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(__file__).parents[3])
    assert done.stdout.strip() == "False", done.stderr


def test_a_unit_says_which_candidates_exclude_which_member_and_why():
    from converters.plan.candidates import Unit

    # the case: a 688-wide down_proj (16 x 43) fits FP8 per tensor (16), not MXFP8 (32) or block FP8 (128)
    down = Unit("mlp.down_proj", ("mlp.down_proj",), ((256, 688),))
    assert down.excluded("fp8-current") == {}
    assert down.excluded("mxfp8") == {"mlp.down_proj": "dim_not_divisible_by_32_for_mxfp8"}
    assert down.excluded("fp8-block") == {"mlp.down_proj": "dim_not_divisible_by_128_for_fp8_block"}
    qkv = Unit("attn.qkv", ("attn.q_proj", "attn.k_proj"), ((128, 128), (64, 128)))
    assert qkv.excluded("fp8-block") == {"attn.q_proj": "fused_group_not_fully_eligible:attn.qkv",
                                         "attn.k_proj": "dim_not_divisible_by_128_for_fp8_block"}
    assert qkv.excluded("mxfp8") == {}
