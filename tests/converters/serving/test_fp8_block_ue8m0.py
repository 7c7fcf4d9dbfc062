"""fp8-block-ue8m0: power-of-two block scales (DeepSeek-V3.1 ``scale_fmt: ue8m0``), checked against fp8-block."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from converters.model.sources import ModelSourceOptions, load_model
from converters.pipeline.request import CalibrationSettings
from converters.serving.fp8_block import FP8_BLOCK, FP8_BLOCK_UE8M0, pow2_scale_inv
from tests.converters.serving.exports import export

BLOCK, UE8M0 = "fp8-block", "fp8-block-ue8m0"


@pytest.fixture(scope="module")
def llama_out(llama_dir):
    return export(llama_dir, (BLOCK, UE8M0), calibration=CalibrationSettings(steps=2, seq_len=16))


def tensors(directory):
    with safe_open(directory / "model.safetensors", "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def is_power_of_two(values):
    mantissa, _ = torch.frexp(values)
    return bool((mantissa == 0.5).all())


def test_every_scale_is_a_power_of_two_and_the_config_says_so(llama_out):
    served = tensors(llama_out / "serving" / UE8M0)
    scales = {name: value for name, value in served.items() if name.endswith("weight_scale_inv")}
    report = json.loads((llama_out / "fp8_report.json").read_text())["serving"][UE8M0]
    assert len(scales) == len(report["quantized"]) == 8  # o, gate, up, down of two layers (k/v have 64 rows)
    for name, scale in scales.items():
        assert scale.dtype == torch.float32 and is_power_of_two(scale), name
    config = json.loads((llama_out / "serving" / UE8M0 / "config.json").read_text())["quantization_config"]
    assert config["scale_fmt"] == "ue8m0" and config["weight_block_size"] == [128, 128]
    assert "scale_fmt" not in json.loads((llama_out / "serving" / BLOCK / "config.json").read_text())[
        "quantization_config"]


def test_bytes_differ_from_the_fp32_export_only_where_scales_differ(llama_out):
    fp32, pow2 = tensors(llama_out / "serving" / BLOCK), tensors(llama_out / "serving" / UE8M0)
    assert fp32.keys() == pow2.keys()
    changed_blocks = 0
    for name, value in fp32.items():
        if not name.endswith("weight_scale_inv"):
            if f"{name}_scale_inv" not in fp32:  # neither a quantized weight nor its scale: the source's bytes
                assert torch.equal(value.view(torch.uint8), pow2[name].view(torch.uint8)), name
            continue
        weight = name.removesuffix("_scale_inv")
        assert (pow2[name] >= value).all() and (pow2[name] < 2 * value).all()  # rounded up, never by 2x or more
        same_scale = (pow2[name] == value).repeat_interleave(128, 0).repeat_interleave(128, 1)
        same_bytes = fp32[weight].view(torch.uint8) == pow2[weight].view(torch.uint8)
        assert same_bytes[same_scale].all(), weight
        changed_blocks += int((pow2[name] != value).sum())
    assert changed_blocks > 0


def test_transformers_loads_the_ue8m0_export(llama_dir, llama_out):
    import transformers

    directory = llama_out / "serving" / UE8M0
    served, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = load_model(llama_dir, ModelSourceOptions())(input_ids=ids).logits
        logits = served.eval()(input_ids=ids).logits
    assert torch.nn.functional.cosine_similarity(logits.float().flatten(), reference.float().flatten(), dim=0) >= 0.99
    # transformers dequantized on this CPU: its weight is the blocks times their power-of-two scales.
    path = "model.layers.1.mlp.up_proj"
    written = tensors(directory)
    scale = written[f"{path}.weight_scale_inv"].repeat_interleave(128, 0).repeat_interleave(128, 1)
    expected = (written[f"{path}.weight"].float() * scale).to(torch.bfloat16)
    assert torch.equal(served.get_submodule(path).weight, expected)


@pytest.mark.parametrize(("amax", "scale_inv"), [
    (448.0, 1.0),  # exactly representable: no rounding
    (448.0001, 2.0),  # just above: the next power of two
    (447.9, 1.0),
    (224.0, 0.5),
    (1.0, 2.0 ** -8),  # 1 / 448 rounds up to 2**-8
    (0.0, 1.0),  # an all-zero block keeps scale 1, as fp8-block does
    (1e-45, 2.0 ** -126),  # no subnormal scale
])
def test_pow2_scale_inv_rounds_up(amax, scale_inv):
    assert pow2_scale_inv(torch.tensor([amax])).item() == scale_inv


def test_pow2_rule_is_transformers_rule():
    """transformers 5.24 ``Fp8Quantize`` (scale_fmt ue8m0): ``2**ceil(log2(1 / (448 / amax)))``; no |w| above 448."""
    amax = torch.rand(200_000, generator=torch.Generator().manual_seed(0)) * torch.logspace(-8, 4, 200_000)
    transformers_rule = torch.pow(2.0, torch.ceil(torch.log2((1.0 / (448.0 / amax)).float())))
    scale = pow2_scale_inv(amax)
    assert torch.equal(scale, transformers_rule)
    assert float((amax / scale).max()) <= 448.0


def test_layer_stats_price_the_power_of_two_scales(llama_dir):
    with safe_open(llama_dir / "model.safetensors", "pt") as handle:
        weight = handle.get_tensor("model.layers.0.mlp.down_proj.weight")
    stats = FP8_BLOCK_UE8M0.layer_stats(weight, FP8_BLOCK_UE8M0.quantize(weight, None, torch.bfloat16))
    assert stats.keys() == {"weight_sqnr_db", "weight_sqnr_db_fp32_scales", "ue8m0_cost_db"}
    assert stats["weight_sqnr_db_fp32_scales"] == FP8_BLOCK.layer_stats(
        weight, FP8_BLOCK.quantize(weight, None, torch.bfloat16))["weight_sqnr_db"]
    assert 25 < stats["weight_sqnr_db"] <= stats["weight_sqnr_db_fp32_scales"] < 40
    assert 0 <= stats["ue8m0_cost_db"] < 3
