"""mxfp8: compressed-tensors MXFP8 read back by transformers + compressed-tensors, checked against its own code."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from converters.model.sources import ModelSourceOptions, load_model
from converters.pipeline.request import CalibrationSettings
from converters.serving.mxfp8 import MXFP8
from tests.converters.serving.exports import export

NAME = "mxfp8"
CALIBRATION = CalibrationSettings(steps=2, seq_len=16)


def convert(model_dir):
    return export(model_dir, (NAME,), calibration=CALIBRATION)


@pytest.fixture(scope="module")
def llama_out(llama_dir):
    return convert(llama_dir)


def tensors(path):
    with safe_open(path, "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def compressed_tensors_mxfp8(weight):
    """compressed-tensors 0.20.1's own MXFP8: observer min/max per 32-group -> calculate_qparams -> compress."""
    from compressed_tensors.compressors.mxfp8.base import MXFP8QuantizationCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    scheme = preset_name_to_scheme("MXFP8", ["Linear"])
    scale, zero_point = compute_dynamic_scales_and_zp(weight, scheme.weights, module=None)
    # llm-compressor initializes a zero point for symmetric schemes too; compress adds it (it turns -0 into +0)
    state = MXFP8QuantizationCompressor.compress({"weight": weight, "weight_scale": scale,
                                                  "weight_zero_point": zero_point}, scheme)
    return state["weight"], state["weight_scale"]


def test_transformers_with_compressed_tensors_loads_the_export(llama_dir, llama_out):
    import transformers
    from compressed_tensors.quantization import QuantizationConfig

    directory = llama_out / "serving" / NAME
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    assert parsed.format == "mxfp8-quantized"
    weights = parsed.config_groups["group_0"].weights
    assert (weights.group_size, weights.strategy, weights.scale_dtype) == (32, "group", torch.uint8)
    assert parsed.config_groups["group_0"].input_activations.dynamic is True
    served, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = load_model(llama_dir, ModelSourceOptions())(input_ids=ids).logits
        logits = served.eval()(input_ids=ids).logits
    assert torch.nn.functional.cosine_similarity(logits.float().flatten(), reference.float().flatten(), dim=0) >= 0.99
    # compressed-tensors decompressed on load: the weight is each group times 2**(exponent - 127)
    path = "model.layers.1.mlp.up_proj"
    written = tensors(directory / "model.safetensors")
    scale = torch.exp2(written[f"{path}.weight_scale"].float() - 127).repeat_interleave(32, 1)
    expected = (written[f"{path}.weight"].float() * scale).to(torch.bfloat16)
    assert torch.equal(served.get_submodule(path).weight, expected)


def test_every_weight_and_scale_equals_compressed_tensors_to_the_bit(llama_dir, llama_out):
    source = tensors(llama_dir / "model.safetensors")
    served = tensors(llama_out / "serving" / NAME / "model.safetensors")
    report = json.loads((llama_out / "fp8_report.json").read_text())["serving"][NAME]
    # Every Linear but the analysis' first (layer 0's q_proj, with its fused k/v) and last (lm_head)
    assert len(report["quantized"]) == 11
    assert not any("mxfp8" in reason for reason in report["skipped"].values())
    for path in report["quantized"]:
        weight, scale = compressed_tensors_mxfp8(source[f"{path}.weight"])
        assert served[f"{path}.weight_scale"].dtype == torch.uint8
        assert served[f"{path}.weight_scale"].shape == (weight.shape[0], weight.shape[1] // 32)
        assert torch.equal(served[f"{path}.weight_scale"], scale), path
        assert torch.equal(served[f"{path}.weight"].view(torch.uint8), weight.view(torch.uint8)), path


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_edge_groups_match_compressed_tensors_in_each_dtype(dtype):
    weight = torch.randn(8, 256, generator=torch.Generator().manual_seed(0)) * torch.logspace(-7, 3, 256)
    weight[0, :32] = 0  # all-zero group
    weight[1, :32] = 1.75  # amax on compressed-tensors' round-up boundary (1.75 * 2**0)
    weight[2, :32] = -1.74
    weight[3, :32] = -0.0  # negative zeros
    weight = weight.to(dtype)
    expected_weight, expected_scale = compressed_tensors_mxfp8(weight)
    quantized, scale = MXFP8.quantize(weight, None, dtype)
    assert torch.equal(scale, expected_scale)
    assert torch.equal(quantized.view(torch.uint8), expected_weight.view(torch.uint8))
    assert scale[1, 0] == 127 - 8 + 1 and scale[2, 0] == 127 - 8  # 1.75 takes the next power of two, 1.74 not


@pytest.mark.parametrize(("in_features", "out_features", "reason"), [
    (128, 64, None),
    (96, 48, None),  # out_features needs no rule: vLLM pads the scale rows itself
    (80, 128, "dim_not_divisible_by_32_for_mxfp8"),
    (48, 256, "dim_not_divisible_by_32_for_mxfp8"),
])
def test_layer_rule(in_features, out_features, reason):
    assert MXFP8.layer_rule(in_features, out_features) == reason


def test_a_layer_with_in_features_not_a_multiple_of_32_stays_in_bf16(tmp_path):
    from converters.model.demo import build_tiny_llama

    # hidden 80: q/k/v/o/gate/up take 80 inputs (80 % 32 == 16); down takes 160 and is quantized.
    out = convert(build_tiny_llama(tmp_path / "llama", hidden_size=80, layers=1))
    report = json.loads((out / "fp8_report.json").read_text())["serving"][NAME]
    assert report["quantized"] == ["model.layers.0.mlp.down_proj"]
    for path in ("model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"):
        assert report["skipped"][path] == "dim_not_divisible_by_32_for_mxfp8"
    config = json.loads((out / "serving" / NAME / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.mlp.up_proj" in config["ignore"] and "model.layers.0.mlp.down_proj" not in config["ignore"]
    served = tensors(out / "serving" / NAME / "model.safetensors")
    assert served["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16
    assert served["model.layers.0.mlp.down_proj.weight_scale"].shape == (80, 5)
