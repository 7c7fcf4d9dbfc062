"""A plan end to end on the tiny Llama: the CLI's plan measured after it is applied, its files read by the
frameworks' own classes (torchao, compressed-tensors), and a conversion job that carries a plan."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from converters.model.sources import ModelSourceOptions
from converters.plan.candidates import BF16, precisions_for, recipe_of
from tests.service_helpers import fp8forge_command

TARGET_KL = 0.001


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    """``fp8forge plan demo/tiny-llama --target-kl 0.001 --gpu b200 --out DIR``: (DIR, plan, environment)."""
    root = tmp_path_factory.mktemp("plan")
    env = {"XDG_CACHE_HOME": str(root / "cache"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
           "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
    done = subprocess.run([*fp8forge_command(), "plan", "demo/tiny-llama", "--target-kl", str(TARGET_KL), "--gpu",
                           "b200", "--calib-steps", "2", "--calib-seq-len", "32", "--max-tokens", "64", "--out",
                           str(root / "out"), "--no-progress"], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr
    assert "target met: True" in done.stdout and "all-fp8" in done.stdout
    return root / "out", json.loads((root / "out" / "plan.json").read_text()), root


def _choices(plan):
    return {row["path"]: row["precision"] for row in plan["layers"]}


def test_the_plan_meets_its_budget_as_measured_after_it_is_applied(planned):
    out, plan, root = planned
    from converters.plan.candidates import Unit
    from converters.plan.contributions import plan_casts
    from converters.quality import measure_quality

    assert plan["target"] == {"name": "target_kl", "value": TARGET_KL, "met": True}
    assert plan["measured"]["plan"]["kl_mean"] <= TARGET_KL
    assert plan["search"]["verifications"][-1]["measured"] == pytest.approx(plan["measured"]["plan"]["kl_mean"],
                                                                            abs=1e-8)
    # measured again here, from the plan's choices alone: the report's figure is the plan applied, not predicted
    rows = [row for row in plan["layers"] if row["planned"]]
    units = {row["path"]: Unit(row["path"], (row["path"],), ((1, 1),)) for row in rows}
    casts = plan_casts({row["path"]: row["precision"] for row in rows}, units)
    again = measure_quality(root / "cache" / "fp8forge" / "demo-models" / "tiny-llama", casts, max_tokens=64)
    assert again.kl_mean == pytest.approx(plan["measured"]["plan"]["kl_mean"], rel=1e-6, abs=1e-12)
    assert plan["measured"]["all_bf16"]["perplexity"] == plan["measured"]["plan"]["perplexity_reference"]


def test_every_linear_has_a_precision_the_gpu_runs_and_its_shape_allows(planned):
    _, plan, _ = planned
    runs, _ = precisions_for("b200")
    choices = _choices(plan)
    assert len(choices) == 15  # every Linear of the tiny Llama, lm_head and the first q/k/v included
    for row in plan["layers"]:
        assert row["precision"] in [BF16, *runs]
        assert row["why"].startswith((f"{row['precision']}:", "not eligible:", "fused group"))
        if row["precision"] != BF16:
            assert not recipe_of(row["precision"]).shape_rule().fails(row["in_features"], row["out_features"])
    # fused groups share a precision; q/k/v are 128 -> 64 for k and v, so no 128-rule format there
    assert len({choices[f"model.layers.1.self_attn.{p}_proj"] for p in "qkv"}) == 1
    assert choices["model.layers.1.self_attn.k_proj"] not in ("fp8-block", "nvfp4")
    assert choices["model.layers.1.mlp.gate_proj"] == choices["model.layers.1.mlp.up_proj"]
    totals = plan["totals"]
    assert totals["weight_bytes"] == sum(row["bytes"] for row in plan["layers"]) < totals["weight_bytes_bf16"]
    assert 0 < totals["fp8_gemm_flop_share"] < 1


def test_torchao_builds_the_fqn_to_config(planned):
    out, plan, _ = planned
    from torchao.core.config import config_from_dict
    from torchao.prototype.mx_formats import MXDynamicActivationMXWeightConfig, NVFP4DynamicActivationNVFP4WeightConfig
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, FqnToConfig, PerBlock, PerTensor

    config = config_from_dict(json.loads((out / "plan" / "torchao_fqn_to_config.json").read_text()))
    assert isinstance(config, FqnToConfig)
    expected = {"fp8-current": Float8DynamicActivationFloat8WeightConfig, "fp8-block":
                Float8DynamicActivationFloat8WeightConfig, "mxfp8": MXDynamicActivationMXWeightConfig,
                "nvfp4": NVFP4DynamicActivationNVFP4WeightConfig}
    for path, precision in _choices(plan).items():
        built = config.fqn_to_config[path]
        if precision == BF16:
            assert built is None
            continue
        assert isinstance(built, expected[precision])
        if precision == "fp8-current":
            assert all(isinstance(g, PerTensor) for g in built.granularity)
        if precision == "fp8-block":
            assert [g.block_size for g in built.granularity] == [(1, 128), (128, 128)] or all(
                isinstance(g, PerBlock) for g in built.granularity)


def test_compressed_tensors_targets_each_layer_with_its_group(planned):
    out, plan, root = planned
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM

    text = (out / "plan" / "compressed_tensors_config.json").read_text()
    config = QuantizationConfig.model_validate(json.loads(text))
    model = AutoModelForCausalLM.from_pretrained(root / "cache" / "fp8forge" / "demo-models" / "tiny-llama")
    apply_quantization_config(model, config)  # compressed-tensors matches the targets itself
    bits = {"fp8-current": (8, "tensor"), "fp8-block": (8, "block"), "mxfp8": (8, "group"),
            "nvfp4": (4, "tensor_group")}
    for path, precision in _choices(plan).items():
        scheme = getattr(model.get_submodule(path), "quantization_scheme", None)
        if precision == BF16:
            assert scheme is None, path
        else:
            strategy = getattr(scheme.weights.strategy, "value", scheme.weights.strategy)
            assert (scheme.weights.num_bits, strategy) == bits[precision], path


def test_megatron_and_modelopt_files_follow_their_readers_rules(planned):
    out, plan, _ = planned
    import yaml

    document = yaml.safe_load((out / "plan" / "megatron_te_precision.yaml").read_text())
    allowed = {"fp8_quantization_recipe", "fp4_quantization_recipe", "custom_recipe_factory", "fp8_format",
               "override_quantized_autocast", "override_nonquantized_autocast", "tp_only_amax_red"}
    for config in document["configs"].values():  # TEQuantizationParams.parse_from_config's rules
        assert set(config) == {"transformer_engine_config_type", "training_recipe"}
        assert config["transformer_engine_config_type"] == "TEQuantizationParams"
        assert set(config["training_recipe"]) <= allowed
        recipe = config["training_recipe"]
        assert not ("fp8_quantization_recipe" in recipe and "fp4_quantization_recipe" in recipe)
        assert recipe.get("fp8_quantization_recipe") in (None, "tensorwise", "blockwise", "mxfp8")
    patterns = {m["pattern"]: m["config"] for m in document["matchers"].values()}
    assert patterns["*decoder.layers.1.self_attention.linear_qkv"] == _choices(plan)["model.layers.1.self_attn.q_proj"]
    assert patterns["*decoder.layers.1.mlp.linear_fc2"] == _choices(plan)["model.layers.1.mlp.down_proj"]
    modelopt = json.loads((out / "plan" / "hf_quant_config.json").read_text())["quantization"]
    assert modelopt["quant_algo"] == "MIXED_PRECISION"
    for path, precision in _choices(plan).items():
        algo = modelopt["quantized_layers"].get(path, {}).get("quant_algo")
        assert algo == {"fp8-current": "FP8", "nvfp4": "NVFP4"}.get(precision), path
    assert "Accelerate cannot express" in (out / "plan" / "README.md").read_text()


def test_a_gpu_without_fp8_is_refused_before_any_work(tmp_path):
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*fp8forge_command(), "plan", "demo/tiny-llama", "--target-kl", "0.01", "--gpu", "a100",
                           "--calib-steps", "1", "--calib-seq-len", "16", "--no-progress"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 2 and "a100 runs none of the FP8/FP4 recipes" in done.stderr


def test_a_conversion_job_writes_its_plan_beside_the_artifact(tmp_path):
    from converters.pipeline.driver import ConversionRequest, run_conversion
    from converters.pipeline.request import CalibrationSettings

    request = ConversionRequest(model="demo/tiny-llama", calibration=CalibrationSettings(steps=2, seq_len=32),
                                plan={"min_sqnr_db": 20, "gpu": "h100"})
    result = run_conversion(request, tmp_path / "out", ModelSourceOptions(demo_dir=tmp_path / "demo"))
    report = json.loads(result.report_path.read_text())
    plan = report["plan"]
    assert plan["made"] and plan["target"]["met"] and plan["gpu"]["precisions"] == ["bf16", "fp8-current", "fp8-block"]
    assert set(report["analysis"]["comparison"]["layers"][0]["sqnr_db"]) >= {"te-current", "te-float8-block"}
    for row in plan["layers"]:
        if row["precision"] != BF16:
            assert row["sqnr_db"][row["precision"]] >= 20
            assert not recipe_of(row["precision"]).shape_rule().fails(row["in_features"], row["out_features"])
    listed = {entry["name"] for entry in result.manifest}
    assert set(plan["files"]) <= listed and "plan/megatron_te_precision.yaml" in listed
    assert torch.isfinite(torch.tensor(plan["measured"]["plan"]["kl_mean"]))


def test_a_candidate_a_layer_cannot_take_shows_no_sqnr_but_its_reason(planned):
    """k/v are 128 -> 64: block FP8 and NVFP4 (both dims % 128) cannot hold them, nor q, fused with them; the plan's
    SQNR per candidate leaves those cells empty and says why, instead of a figure for a choice it could not make."""
    _, plan, _ = planned
    rows = {row["path"]: row for row in plan["layers"]}
    k, q = rows["model.layers.1.self_attn.k_proj"], rows["model.layers.1.self_attn.q_proj"]
    assert k["excluded"] == {"fp8-block": "dim_not_divisible_by_128_for_fp8_block",
                             "nvfp4": "dim_not_divisible_by_128_for_nvfp4"}
    assert k["sqnr_db"]["fp8-block"] is None and k["sqnr_db"]["nvfp4"] is None
    assert k["sqnr_db"]["mxfp8"] is not None and k["sqnr_db"]["fp8-current"] is not None
    assert set(q["excluded"]) == {"fp8-block", "nvfp4"} and q["sqnr_db"]["fp8-block"] is None
    assert all(reason.startswith("fused_group_not_fully_eligible:") for reason in q["excluded"].values())
    gate = rows["model.layers.1.mlp.gate_proj"]
    assert gate["excluded"] == {} and None not in gate["sqnr_db"].values()
