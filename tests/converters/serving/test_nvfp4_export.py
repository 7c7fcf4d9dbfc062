"""compressed-tensors NVFP4 serving exports: bytes equal to compressed-tensors' own, loaded back by transformers."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from converters.model.sources import ModelSourceOptions, load_model
from converters.pipeline.request import CalibrationSettings
from converters.serving import SERVING_FORMATS, select_serving
from converters.serving.nvfp4 import NVFP4, global_scale, quantize_nvfp4
from tests.converters.serving.exports import cosine, export

W4A4, A16 = "nvfp4", "nvfp4-a16"
CALIBRATION = CalibrationSettings(steps=3, seq_len=32)
QKV = [f"model.layers.1.self_attn.{name}_proj" for name in "qkv"]
GATE_UP = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]


@pytest.fixture(scope="module")
def llama_out(llama_dir):
    return export(llama_dir, (W4A4, A16), calibration=CALIBRATION)


def compressed_tensors_reference(weight, amax):
    """What llm-compressor writes for ``weight`` with group amax ``amax``, through compressed-tensors' functions."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, generate_gparam

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    amax = torch.tensor([amax], dtype=weight.dtype)
    gparam = generate_gparam(-amax, amax)
    groups = weight.unflatten(-1, (weight.shape[1] // 16, 16))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gparam)
    return NVFP4PackedCompressor.compress({"weight": weight, "weight_scale": scale, "weight_global_scale": gparam},
                                          scheme)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packed_bytes_and_scales_equal_compressed_tensors(dtype):
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    weight = (torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 0.05).to(dtype)
    weight[0, :16] = 0  # an all-zero block: its scale is E4M3's eps
    weight[1, 3] = -0.0
    weight[2, :16] *= 1e-4  # a block far below the tensor's amax
    amax = float(weight.float().abs().amax()) * 1.5  # a fused group's amax, larger than this member's
    packed, scale, gparam = quantize_nvfp4(weight, amax)
    expected = compressed_tensors_reference(weight, amax)
    assert torch.equal(packed, expected["weight_packed"])
    assert torch.equal(scale.view(torch.uint8), expected["weight_scale"].view(torch.uint8))
    assert torch.equal(gparam, expected["weight_global_scale"])
    for input_amax in (0.0, 3.25, 1e4):
        observed = torch.tensor([input_amax], dtype=dtype)
        assert torch.equal(global_scale(observed), generate_gparam(-observed, observed))


def test_the_export_holds_compressed_tensors_bytes_with_shared_global_scales(llama_dir, llama_out):
    directory = llama_out / "serving" / W4A4
    with safe_open(directory / "model.safetensors", "pt") as served, \
            safe_open(llama_dir / "model.safetensors", "pt") as source:
        for group in (QKV, GATE_UP, ["model.layers.1.mlp.down_proj"]):
            amax = max(float(source.get_tensor(f"{path}.weight").float().abs().max()) for path in group)
            scales = {path: served.get_tensor(f"{path}.weight_global_scale") for path in group}
            inputs = {path: served.get_tensor(f"{path}.input_global_scale") for path in group}
            assert all(torch.equal(scale, scales[group[0]]) for scale in scales.values())  # vLLM requires it
            assert all(torch.equal(scale, inputs[group[0]]) for scale in inputs.values())
            for path in group:
                weight = source.get_tensor(f"{path}.weight")
                expected = compressed_tensors_reference(weight, amax)
                assert f"{path}.weight" not in served.keys()
                packed = served.get_tensor(f"{path}.weight_packed")
                assert packed.dtype == torch.uint8 and packed.shape == (weight.shape[0], weight.shape[1] // 2)
                assert torch.equal(packed, expected["weight_packed"])
                assert torch.equal(served.get_tensor(f"{path}.weight_scale").view(torch.uint8),
                                   expected["weight_scale"].view(torch.uint8))
                assert torch.equal(scales[path], expected["weight_global_scale"])


def test_input_global_scale_comes_from_the_calibrated_amax(llama_out):
    from compressed_tensors.quantization.utils.helpers import generate_gparam

    report = json.loads((llama_out / "fp8_report.json").read_text())
    amax = report["serving"][W4A4]["input_amax"]["model.layers.1.mlp.down_proj"]
    observed = torch.tensor([amax], dtype=torch.bfloat16)
    with safe_open(llama_out / "serving" / W4A4 / "model.safetensors", "pt") as served:
        assert torch.equal(served.get_tensor("model.layers.1.mlp.down_proj.input_global_scale"),
                           generate_gparam(-observed, observed))
    with safe_open(llama_out / "serving" / A16 / "model.safetensors", "pt") as served:
        assert not [key for key in served.keys() if key.endswith("input_global_scale")]


@pytest.mark.parametrize("name", [W4A4, A16])
def test_transformers_with_compressed_tensors_loads_the_export(llama_dir, llama_out, name):
    import transformers
    from compressed_tensors.quantization import QuantizationConfig

    directory = llama_out / "serving" / name
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    assert parsed.format == "nvfp4-pack-quantized"
    assert (parsed.config_groups["group_0"].input_activations is None) == (name == A16)
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        reference = load_model(llama_dir, ModelSourceOptions())(input_ids=ids).logits
        served = model.eval()(input_ids=ids).logits
    # compressed-tensors runs the packed weights (and, for W4A4, FP4 activations with input_global_scale) on CPU;
    # measured 0.985 (nvfp4) and 0.991 (nvfp4-a16) on this model
    assert cosine(served, reference) >= 0.97


def test_a_layer_nvfp4_cannot_store_is_refused_with_its_fused_group(llama_out):
    report = json.loads((llama_out / "fp8_report.json").read_text())
    odd = copy.deepcopy(report["analysis"] if "analysis" in report else report)
    layer = next(layer for layer in odd["layers"] if layer["path"] == "model.layers.1.self_attn.k_proj")
    layer["in_features"] = 40  # not whole 16-element blocks; a report from another rule could let it through
    selection = select_serving(NVFP4, odd, lambda name: name)
    assert selection.skipped["model.layers.1.self_attn.k_proj"] == "in_features_not_divisible_by_16_for_nvfp4"
    for path in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"):
        assert selection.skipped[path] == "fused_group_not_fully_eligible:model.layers.1.self_attn.qkv"
    assert "model.layers.1.self_attn.o_proj" in selection.quantized
    assert SERVING_FORMATS[W4A4].layer_rule(4096, 40) is None


def test_skipped_layers_are_ignored_in_the_config(llama_out):
    report = json.loads((llama_out / "fp8_report.json").read_text())["serving"][W4A4]
    config = json.loads((llama_out / "serving" / W4A4 / "config.json").read_text())["quantization_config"]
    assert sorted(config["ignore"]) == sorted(report["skipped"]) and "lm_head" in config["ignore"]
