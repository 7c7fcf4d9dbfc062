"""Serving exports: read back by transformers + compressed-tensors, checked tensor by tensor against the rules."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from converters.errors import ConversionError, Fp8ForgeError
from converters.model.safetensors_stream import read_tensor_index
from converters.model.sources import ModelSourceOptions, load_model
from converters.pipeline.driver import NullSink, run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.serving import SERVING_FORMATS
from service.cli.main import main
from tests.models import minilm_dir

STATIC, DYNAMIC, BLOCK = "compressed-tensors-fp8", "compressed-tensors-fp8-dynamic", "fp8-block"
CALIBRATION = CalibrationSettings(steps=3, seq_len=32)


@pytest.fixture(scope="module")
def llama_out(llama_dir):
    out = llama_dir.parent / "out"
    request = ConversionRequest(model=str(llama_dir), recipe={"backend": "te"}, calibration=CALIBRATION,
                                serving_formats=(STATIC, DYNAMIC, BLOCK))
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(llama_dir.parent,)))
    return out


def cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def load_plainly(directory, cls_name="AutoModelForCausalLM"):
    import transformers

    model, info = getattr(transformers, cls_name).from_pretrained(directory, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return model.eval()


@pytest.mark.parametrize("name", [STATIC, DYNAMIC])
def test_transformers_with_compressed_tensors_loads_the_export(llama_dir, llama_out, name):
    from compressed_tensors.quantization import QuantizationConfig

    directory = llama_out / "serving" / name
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    parsed = QuantizationConfig.model_validate(config)
    assert parsed.quant_method == "compressed-tensors" and parsed.format == "float-quantized"
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = load_model(llama_dir, ModelSourceOptions())(input_ids=ids).logits
        served = load_plainly(directory)(input_ids=ids).logits
    assert cosine(served, reference) >= 0.99


def test_real_minilm_serving_export_keeps_its_embeddings(tmp_path):
    directory = minilm_dir()
    out = tmp_path / "out"
    request = ConversionRequest(model=str(directory), recipe={"backend": "ao"}, calibration=CALIBRATION,
                                serving_formats=(STATIC,))
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(directory.parent,)))
    ids = torch.tensor([[101, 7592, 2088, 2003, 1037, 3231, 1012, 102] * 2])
    with torch.no_grad():
        reference = load_model(directory, ModelSourceOptions())(input_ids=ids).last_hidden_state
        served = load_plainly(out / "serving" / STATIC, "AutoModel")(input_ids=ids).last_hidden_state
    assert cosine(served, reference) >= 0.99
    report = json.loads((out / "fp8_report.json").read_text())
    # 35 eligible for training; layer 0's key and value stay with its query (the first Linear) in high precision.
    assert len(report["serving"][STATIC]["quantized"]) == 33


def test_fused_groups_are_quantized_together_and_the_rest_ignored(llama_out):
    report = json.loads((llama_out / "fp8_report.json").read_text())["serving"][STATIC]
    quantized, skipped = set(report["quantized"]), report["skipped"]
    # The first-Linear rule keeps q_proj of layer 0 in high precision, so k_proj and v_proj stay with it.
    layer0 = [f"model.layers.0.self_attn.{name}_proj" for name in "qkv"]
    assert not quantized & set(layer0)
    assert skipped["model.layers.0.self_attn.k_proj"] == "fused_group_not_fully_eligible:model.layers.0.self_attn.qkv"
    assert {f"model.layers.1.self_attn.{name}_proj" for name in "qkvo"} <= quantized
    config = json.loads((llama_out / "serving" / STATIC / "config.json").read_text())["quantization_config"]
    assert sorted(config["ignore"]) == sorted(skipped) and "lm_head" in config["ignore"]


def test_static_scales_follow_the_formulas(llama_dir, llama_out):
    report = json.loads((llama_out / "fp8_report.json").read_text())
    amax = report["calibration"]["layers"]
    with safe_open(llama_out / "serving" / STATIC / "model.safetensors", "pt") as served, \
            safe_open(llama_dir / "model.safetensors", "pt") as source:
        group = [f"model.layers.1.self_attn.{name}_proj" for name in "qkv"]
        shared = max(max(step[0] for step in amax[path]["amax_forward"]) for path in group)
        for path in [*group, "model.layers.1.mlp.down_proj"]:
            weight, original = served.get_tensor(f"{path}.weight"), source.get_tensor(f"{path}.weight")
            scale, input_scale = served.get_tensor(f"{path}.weight_scale"), served.get_tensor(f"{path}.input_scale")
            assert weight.dtype == torch.float8_e4m3fn and weight.shape == original.shape
            assert scale.shape == (1,) and input_scale.shape == (1,) and scale.dtype == torch.bfloat16
            assert scale == original.abs().max() / 448  # in bf16, as compressed-tensors computes it
            assert torch.equal(weight, (original / scale).clamp(-448, 448).to(torch.float8_e4m3fn))
            expected_input = max(step[0] for step in amax[path]["amax_forward"]) if "mlp" in path else shared
            assert input_scale == torch.tensor([expected_input], dtype=torch.bfloat16) / 448
            assert cosine(weight.float() * scale.float(), original) > 0.999


def test_dynamic_scales_are_per_channel_and_no_input_scale(llama_dir, llama_out):
    path = "model.layers.1.mlp.up_proj"
    with safe_open(llama_out / "serving" / DYNAMIC / "model.safetensors", "pt") as served, \
            safe_open(llama_dir / "model.safetensors", "pt") as source:
        original = source.get_tensor(f"{path}.weight")
        scale = served.get_tensor(f"{path}.weight_scale")
        assert scale.shape == (original.shape[0], 1)
        assert torch.equal(scale, original.abs().amax(dim=1, keepdim=True) / 448)
        assert f"{path}.input_scale" not in served.keys()


def test_untouched_tensors_are_the_source_bytes(llama_dir, llama_out):
    source, _ = read_tensor_index(llama_dir / "model.safetensors")
    served, _ = read_tensor_index(llama_out / "serving" / STATIC / "model.safetensors")
    quantized = {f"{path}.weight" for path in json.loads((llama_out / "fp8_report.json").read_text())
                 ["serving"][STATIC]["quantized"]}
    untouched = [name for name in source if name not in quantized]
    assert "model.embed_tokens.weight" in untouched and "model.layers.0.self_attn.q_proj.weight" in untouched

    def raw(entry):
        with open(entry.path, "rb") as handle:
            handle.seek(entry.start)
            return handle.read(entry.nbytes)

    assert all(raw(source[name]) == raw(served[name]) for name in untouched)


def test_transformers_loads_the_block_export(llama_dir, llama_out):
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    served = load_plainly(llama_out / "serving" / BLOCK)
    with torch.no_grad():
        reference = load_model(llama_dir, ModelSourceOptions())(input_ids=ids).logits
        assert cosine(served(input_ids=ids).logits, reference) >= 0.99
    config = json.loads((llama_out / "serving" / BLOCK / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "fp8" and config["weight_block_size"] == [128, 128]
    # transformers dequantized on this CPU; its weights must equal the blocks times their scales.
    path = "model.layers.1.mlp.up_proj"
    with safe_open(llama_out / "serving" / BLOCK / "model.safetensors", "pt") as handle:
        weight, scale = handle.get_tensor(f"{path}.weight"), handle.get_tensor(f"{path}.weight_scale_inv")
    rows, columns = weight.shape
    assert scale.dtype == torch.float32 and scale.shape == (rows // 128, columns // 128)
    expected = weight.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    torch.testing.assert_close(served.get_submodule(path).weight.float(), expected.to(torch.bfloat16).float())


def test_block_scales_and_the_128_rule(llama_dir, llama_out):
    report = json.loads((llama_out / "fp8_report.json").read_text())["serving"][BLOCK]
    # The tiny Llama's k/v projections have 64 outputs: no whole 128x128 block, so q/k/v stay together in bf16.
    assert report["skipped"]["model.layers.1.self_attn.k_proj"] == "dim_not_divisible_by_128"
    assert report["skipped"]["model.layers.1.self_attn.q_proj"].startswith("fused_group_not_fully_eligible")
    assert "model.layers.1.self_attn.o_proj" in report["quantized"]
    path = "model.layers.0.mlp.down_proj"
    with safe_open(llama_out / "serving" / BLOCK / "model.safetensors", "pt") as served, \
            safe_open(llama_dir / "model.safetensors", "pt") as source:
        original, scale = source.get_tensor(f"{path}.weight").float(), served.get_tensor(f"{path}.weight_scale_inv")
    assert torch.equal(scale[0, 1], original[:128, 128:256].abs().max() / 448)
    config = json.loads((llama_out / "serving" / BLOCK / "config.json").read_text())["quantization_config"]
    assert sorted(config["modules_to_not_convert"]) == sorted(report["skipped"])


class CountingSink(NullSink):
    def __init__(self):
        super().__init__()
        self.stage_name, self.calibration_events = None, 0

    def stage(self, name):
        self.stage_name = name

    def progress(self, done, total, unit="step", **detail):
        self.calibration_events += self.stage_name == "calibrate"


def test_an_extra_format_costs_no_second_calibration(llama_dir, tmp_path):
    counts = []
    for formats in ((), (STATIC, DYNAMIC)):
        sink = CountingSink()
        request = ConversionRequest(model=str(llama_dir), recipe={"backend": "te"}, calibration=CALIBRATION,
                                    serving_formats=formats)
        run_conversion(request, tmp_path / f"out{len(formats)}", ModelSourceOptions(allowed_roots=(llama_dir.parent,)),
                       sink)
        counts.append(sink.calibration_events)
    assert counts[0] == counts[1] == 2  # one event per layer, once


def test_unknown_or_repeated_formats_name_the_field():
    with pytest.raises(Fp8ForgeError, match="unknown serving format 'gguf'") as info:
        ConversionRequest.from_dict({"model": "org/name", "serving_formats": [STATIC, "gguf"]})
    assert info.value.field == "serving_formats[1]"
    with pytest.raises(Fp8ForgeError, match="twice"):
        ConversionRequest(model="org/name", serving_formats=(STATIC, STATIC))
    assert {STATIC, DYNAMIC, BLOCK} <= set(SERVING_FORMATS)


def test_a_format_with_nothing_to_quantize_fails_before_calibration(llama_dir, tmp_path, capsys):
    # Only layer 0's q/k/v are included, and the first-Linear rule keeps q_proj out: the group cannot be served.
    request = ConversionRequest(model=str(llama_dir), recipe={"backend": "te"}, calibration=CALIBRATION,
                                include=tuple(f"layers.0.self_attn.{name}_proj" for name in "qkv"),
                                serving_formats=(DYNAMIC,))
    sink = CountingSink()
    with pytest.raises(ConversionError, match="would quantize no layer") as info:
        run_conversion(request, tmp_path / "out", ModelSourceOptions(allowed_roots=(llama_dir.parent,)), sink)
    assert info.value.field == "serving_formats[0]" and sink.calibration_events == 0
    assert not (tmp_path / "out").exists()
    code = main(["convert", str(llama_dir), "--out", str(tmp_path / "cli"), "--allow-root", str(llama_dir.parent),
                 "--serving", "nope", "--no-progress"])
    assert code == 2 and "unknown serving format 'nope'" in capsys.readouterr().err
