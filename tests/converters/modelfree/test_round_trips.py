"""Round trips through the FP8 formats, each step measured against transformers' own loader of the same file:
bf16 -> fp8-block -> bf16 and bf16 -> compressed-tensors FP8 (dynamic) -> bf16 hold exactly the values
transformers gives when it loads the FP8 file with ``dequantize=True``; a quantized source re-targeted to another
format (fp8-block -> fp8-block-ue8m0, FP8 -> TE training artifact) equals the same conversion of that bf16."""

from __future__ import annotations

import json

import pytest
import torch

from converters.model.files import INDEX_NAME
from converters.modelfree import convert_model_free
from service.cli.main import main

ROUND_TRIPS = ("fp8-block", "compressed-tensors-fp8-dynamic")


def bits(tensor):
    return tensor.contiguous().view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The tiny Llama (bf16) in shards of 100 KB, and its model-free fp8-block and compressed-tensors exports."""
    from transformers import AutoModelForCausalLM

    from converters.model.demo import build_tiny_llama

    root = tmp_path_factory.mktemp("round_trips")
    AutoModelForCausalLM.from_pretrained(build_tiny_llama(root / "one")).save_pretrained(
        root / "bf16", max_shard_size="100KB")
    for fmt in ROUND_TRIPS:
        convert_model_free(root / "bf16", root / fmt, fmt, skip_first_last=False)
    return root


def transformers_dequantized(directory, fmt):
    """transformers 5.24 loading an FP8 export dequantized: FineGrainedFP8's Fp8Dequantize for fp8-block,
    compressed-tensors' own decompressor (through transformers' integration) for compressed-tensors."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    config = FineGrainedFP8Config(dequantize=True) if fmt == "fp8-block" else CompressedTensorsConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=config,
                                                dtype=torch.bfloat16).state_dict()


def loaded(directory):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.state_dict()


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("fmt", ROUND_TRIPS)
def test_bf16_to_fp8_and_back_equals_transformers_dequantization(root, tmp_path, fmt, capsys):
    out = tmp_path / "bf16-again"
    assert main(["requantize", str(root / fmt), "--out", str(out), "--to", "bf16", "--workers", "2",
                 "--allow-root", str(root)]) == 0, capsys.readouterr().err
    ours, reference, original = loaded(out), transformers_dequantized(root / fmt, fmt), loaded(root / "bf16")
    assert set(ours) == set(reference)
    quantized = json.loads((root / fmt / "requantize_report.json").read_text())["quantized"]
    expected = {f"model.layers.{i}.{proj}.weight" for i in (0, 1) for proj in ("self_attn.o_proj", "mlp.down_proj")}
    assert expected <= set(quantized)
    for key, value in reference.items():
        assert ours[key].dtype == value.dtype == torch.bfloat16, key
        assert torch.equal(bits(ours[key]), bits(value)), key
        if key in quantized:  # not the original: quantization dropped information
            error = (ours[key].float() - original[key].float()).norm() / original[key].float().norm()
            assert 0 < error < 0.08, (key, float(error))
        else:
            assert torch.equal(bits(ours[key]), bits(original[key])), key
    # the source's names and sharding: the bf16 checkpoint's own index
    assert json.loads((out / INDEX_NAME).read_text())["weight_map"] == json.loads(
        (root / "bf16" / INDEX_NAME).read_text())["weight_map"]


def test_fp8_block_retargeted_to_ue8m0_equals_the_conversion_of_its_bf16(root, tmp_path):
    """fp8-block (fp32 scales) -> fp8-block-ue8m0 dequantizes one weight at a time: the bytes are those of the
    conversion of the dequantized bf16 checkpoint written out first."""
    convert_model_free(root / "fp8-block", tmp_path / "direct", "fp8-block-ue8m0")
    convert_model_free(root / "fp8-block", tmp_path / "bf16", "bf16")
    convert_model_free(tmp_path / "bf16", tmp_path / "through-bf16", "fp8-block-ue8m0")
    files = sorted(path.name for path in (tmp_path / "direct").glob("*.safetensors"))
    assert len(files) >= 4
    assert files == sorted(path.name for path in (tmp_path / "through-bf16").glob("*.safetensors"))
    for name in [*files, INDEX_NAME]:
        assert (tmp_path / "direct" / name).read_bytes() == (tmp_path / "through-bf16" / name).read_bytes(), name
    config = json.loads((tmp_path / "direct" / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config.get("scale_fmt") == "ue8m0"


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
def test_compressed_tensors_fp8_source_converts_to_a_te_artifact(root, tmp_path, capsys):
    """FP8 -> TE training artifact: the artifact's weights are transformers' dequantization of the source."""
    fmt = "compressed-tensors-fp8-dynamic"
    out = tmp_path / "te"
    assert main(["convert", str(root / fmt), "--out", str(out), "--backend", "te", "--calib-steps", "2",
                 "--calib-seq-len", "16", "--no-progress", "--allow-root", str(root)]) == 0, capsys.readouterr().err
    reference, ours = transformers_dequantized(root / fmt, fmt), loaded(out)
    assert set(ours) == set(reference)
    for key, value in reference.items():
        assert torch.equal(bits(ours[key]), bits(value)), key
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["fp8"]["dequantized_from"]["scheme"] == \
        "compressed-tensors-fp8"
    assert config["fp8"]["converted_modules"]


def test_whole_model_mode_dequantizes_the_same_weights(root, tmp_path, capsys):
    """Backward calibration loads the whole model at once (not layer by layer): the same loader dequantizes each
    weight, so the calibration sees transformers' dequantization there too."""
    fmt = "fp8-block"
    out = tmp_path / "te"
    assert main(["convert", str(root / fmt), "--out", str(out), "--backend", "te", "--calib-steps", "1",
                 "--calib-seq-len", "16", "--calib-backward", "--no-progress", "--allow-root", str(root)]) == 0, \
        capsys.readouterr().err
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["pipeline"]["mode"] == "whole_model"
    reference = transformers_dequantized(root / fmt, fmt)
    key = "model.layers.1.mlp.down_proj"
    weight_amax = report["calibration"]["layers"][key]["amax_forward"][0][1]
    assert weight_amax == pytest.approx(float(reference[f"{key}.weight"].float().abs().max()), rel=1e-6)
    ours = loaded(out)
    assert all(torch.equal(bits(ours[name]), bits(value)) for name, value in reference.items())
