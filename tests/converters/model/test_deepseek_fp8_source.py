"""A DeepSeek-V3-shaped checkpoint in DeepSeek's FP8 block layout as a source: analysed, dequantized by
``fp8forge requantize --to bf16`` and converted to a TE training artifact by ``fp8forge convert``; every weight
equals what transformers' own loader gives for the same file (``FineGrainedFP8Config(dequantize=True)``)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from service.cli.main import main
from tests.converters.model.deepseek_fp8 import DEEPSEEK_V3_FP8_CONFIG, save_deepseek_v3_fp8


def bits(tensor):
    return tensor.contiguous().view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    save_deepseek_v3_fp8(root / "fp8", bf16_directory=root / "bf16")
    return root


@pytest.fixture(scope="module")
def transformers_dequantized(root):
    """transformers 5.24 loading the FP8 checkpoint with ``dequantize=True``: its Fp8Dequantize runs per stored
    (weight, weight_scale_inv) pair before the MoE converter stacks the experts."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(root / "fp8", quantization_config=FineGrainedFP8Config(
        dequantize=True), dtype=torch.bfloat16)
    return model.state_dict()


def loaded_plainly(directory):
    """A high-precision checkpoint as transformers loads it (experts stacked, as in the FP8 load)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.state_dict()


def assert_same_bits(ours, reference):
    assert set(ours) == set(reference)
    for key, value in reference.items():
        assert ours[key].dtype == value.dtype, key
        assert torch.equal(bits(ours[key]), bits(value)), key


def test_the_fixture_is_deepseek_v3_layout(root):
    config = json.loads((root / "fp8" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3" and config["quantization_config"] == DEEPSEEK_V3_FP8_CONFIG
    assert config["first_k_dense_replace"] == 1 and config["n_shared_experts"] == 1
    with safe_open(root / "fp8" / "model.safetensors", "pt") as handle:
        names = set(handle.keys())  # noqa: SIM118
        for module in ("self_attn.kv_a_proj_with_mqa", "mlp.experts.3.down_proj", "mlp.shared_experts.up_proj"):
            assert handle.get_slice(f"model.layers.1.{module}.weight").get_dtype() == "F8_E4M3"
            assert handle.get_slice(f"model.layers.1.{module}.weight_scale_inv").get_dtype() == "F32"
        assert handle.get_slice("model.layers.1.self_attn.q_b_proj.weight_scale_inv").get_shape() == [3, 1]
        assert handle.get_slice("model.layers.1.mlp.gate.weight").get_dtype() == "F32"
    assert "model.layers.0.mlp.gate_proj.weight_scale_inv" in names and "lm_head.weight_scale_inv" not in names


def test_analyze_reports_the_fp8_block_source_and_its_layers(root, capsys):
    assert main(["analyze", str(root / "fp8"), "--allow-root", str(root), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    block = report["source_quantization"]
    assert block["scheme"] == "fp8-block" and block["block_size"] == [128, 128]
    assert block["activation_scheme"] == "dynamic"
    quantized = set(block["quantized_modules"])
    assert {"model.layers.0.self_attn.q_a_proj", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.experts.2.up_proj",
            "model.layers.1.mlp.shared_experts.gate_proj", "model.layers.1.self_attn.kv_b_proj"} <= quantized
    assert len(quantized) == 2 * 5 + 3 + 4 * 3 + 3  # MLA x2 layers, dense MLP, 4 experts, the shared expert
    assert "lm_head.weight" in block["unquantized_weights"] and "model.layers.1.mlp.gate.weight" in \
        block["unquantized_weights"]
    paths = {layer["path"] for layer in report["layers"]}
    assert {"model.layers.0.self_attn.kv_a_proj_with_mqa", "model.layers.1.mlp.shared_experts.down_proj"} <= paths


def test_requantize_to_bf16_equals_transformers_dequantization(root, transformers_dequantized, capsys):
    out = root / "requantized-bf16"
    assert main(["requantize", str(root / "fp8"), "--out", str(out), "--to", "bf16", "--allow-root", str(root)]) == 0
    with safe_open(out / "model.safetensors", "pt") as handle:
        assert not any(name.endswith("_scale_inv") for name in handle.keys())  # noqa: SIM118
        assert handle.get_slice("model.layers.1.mlp.experts.0.gate_proj.weight").get_dtype() == "BF16"
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    assert_same_bits(loaded_plainly(out), transformers_dequantized)


def test_convert_to_a_te_artifact_holds_transformers_dequantization(root, transformers_dequantized, capsys):
    recipe = root / "te.json"
    recipe.write_text(json.dumps({"backend": "te", "margin": 0}))
    out = root / "te-artifact"
    code = main(["convert", str(root / "fp8"), "--out", str(out), "--recipe", str(recipe), "--calib-steps", "2",
                 "--calib-seq-len", "16", "--no-progress", "--allow-root", str(root)])
    assert code == 0, capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["fp8"]["dequantized_from"]["scheme"] == "fp8-block"
    assert "model.layers.1.self_attn.kv_b_proj" in config["fp8"]["converted_modules"]
    assert_same_bits(loaded_plainly(out), transformers_dequantized)
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["pipeline"]["mode"] == "layer_sequential"
    # calibration saw the dequantized weights, not the E4M3 codes read as bf16: each weight's amax is a real one
    weight_amax = report["calibration"]["layers"]["model.layers.1.self_attn.kv_b_proj"]["amax_forward"][0][1]
    dequantized = transformers_dequantized["model.layers.1.self_attn.kv_b_proj.weight"]
    assert weight_amax == pytest.approx(float(dequantized.float().abs().max()), rel=1e-6)
    # the artifact's weight file is the one requantize --to bf16 writes, byte for byte
    requantized = root / "requantized-for-bytes"
    assert main(["requantize", str(root / "fp8"), "--out", str(requantized), "--to", "bf16",
                 "--allow-root", str(root)]) == 0
    assert (out / "model.safetensors").read_bytes() == (requantized / "model.safetensors").read_bytes()


def test_serving_export_of_the_fp8_source_passes_vllms_loading_rules(root, capsys):
    """The serving export of a DeepSeek-V3 source loads as vLLM builds the model: the router (built without a
    quantization config, with its fp32 e_score_correction_bias) and MLA's q_a/kv_a pair (one fused_qkv_a_proj)
    are kept together in high precision, and the audit finds nothing."""
    out = root / "serving-artifact"
    code = main(["convert", str(root / "fp8"), "--out", str(out), "--serving", "fp8-block", "--serving",
                 "compressed-tensors-fp8", "--calib-steps", "1", "--calib-seq-len", "16", "--no-progress",
                 "--allow-root", str(root)])
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "fp8_report.json").read_text())
    for name in ("fp8-block", "compressed-tensors-fp8"):
        audit = report["serving"][name]["load_audit"]
        assert audit["audited"] and audit["ok"] and audit["problems"] == [], audit
    config = json.loads((out / "serving" / "fp8-block" / "config.json").read_text())
    kept = config["quantization_config"]["modules_to_not_convert"]
    # q_a_proj is the first Linear (kept), so its fused partner kv_a_proj_with_mqa is kept with it
    assert {"model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_a_proj_with_mqa"} <= set(kept)
    with safe_open(out / "serving" / "fp8-block" / "model.safetensors", "pt") as export, \
            safe_open(root / "bf16" / "model.safetensors", "pt") as source:
        assert export.get_tensor("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").dtype == torch.bfloat16
        assert export.get_tensor("model.layers.1.self_attn.q_a_proj.weight").dtype == torch.float8_e4m3fn
        bias = "model.layers.1.mlp.gate.e_score_correction_bias"
        assert torch.equal(export.get_tensor(bias), source.get_tensor(bias))
