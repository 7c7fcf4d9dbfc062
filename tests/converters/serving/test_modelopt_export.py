"""ModelOpt unified HF checkpoints: the files, names, dtypes and shapes vLLM's modelopt loader reads, and scales
that follow ModelOpt's formulas."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors import safe_open

from converters.model.sources import ModelSourceOptions, load_model
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.serving import plan_serving
from converters.serving.modelopt import MODELOPT_FP8, MODELOPT_NVFP4

FP8, NVFP4 = "modelopt-fp8", "modelopt-nvfp4"
CALIBRATION = CalibrationSettings(steps=3, seq_len=32)
QKV = [f"model.layers.1.self_attn.{name}_proj" for name in "qkv"]
GATE_UP = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from converters.model.demo import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("modelopt") / "llama")  # bf16


@pytest.fixture(scope="module")
def llama_out(llama_dir):
    out = llama_dir.parent / "out"
    request = ConversionRequest(model=str(llama_dir), recipe={"backend": "te"}, calibration=CALIBRATION,
                                serving_formats=(FP8, NVFP4))
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(llama_dir.parent,)))
    return out


def cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def dequantize_nvfp4(packed, scale, scale_2):
    """vLLM's / ModelOpt's reading: low nibble first, code -> E2M1, times the block scale and weight_scale_2."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
    values = E2M1[codes.long()].unflatten(-1, (-1, 16))
    return (values * (scale.float() * scale_2).unsqueeze(-1)).flatten(-2)


def dequantized_state(directory, name):
    """The served weights back in fp32 (the high-precision tensors as stored), keyed as the model's state dict."""
    state = {}
    with safe_open(directory / "model.safetensors", "pt") as served:
        keys = set(served.keys())
        for key in keys:
            if key.endswith(("_scale", "_scale_2")):
                continue
            tensor = served.get_tensor(key)
            prefix = key.removesuffix("weight")
            if f"{prefix}input_scale" in keys:
                scale = served.get_tensor(f"{prefix}weight_scale")
                tensor = tensor.float() * scale if name == FP8 else \
                    dequantize_nvfp4(tensor, scale, served.get_tensor(f"{prefix}weight_scale_2"))
            state[key] = tensor
    return state


@pytest.mark.parametrize(("name", "algo"), [(FP8, "FP8"), (NVFP4, "NVFP4")])
def test_hf_quant_config_and_config_json_as_modelopt_writes_them(llama_out, name, algo):
    directory = llama_out / "serving" / name
    report = json.loads((llama_out / "fp8_report.json").read_text())["serving"][name]
    hf = json.loads((directory / "hf_quant_config.json").read_text())
    assert hf["producer"]["name"] == "modelopt"
    expected = {"quant_algo": algo, "kv_cache_quant_algo": None, **({"group_size": 16} if algo == "NVFP4" else {}),
                "exclude_modules": sorted(report["skipped"])}
    assert hf["quantization"] == expected and list(hf["quantization"]) == list(expected)
    assert "lm_head" in hf["quantization"]["exclude_modules"]
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    # convert_hf_quant_config_format's output: what vLLM reads from config.json when hf_quant_config.json is absent
    assert config["quant_method"] == "modelopt" and config["quant_algo"] == algo
    assert config["ignore"] == hf["quantization"]["exclude_modules"] and config["producer"] == hf["producer"]
    args = config["config_groups"]["group_0"]
    assert args["targets"] == ["Linear"] and args["weights"]["num_bits"] == (8 if algo == "FP8" else 4)
    assert args["input_activations"]["dynamic"] is False


@pytest.mark.parametrize("name", [FP8, NVFP4])
def test_tensor_names_dtypes_and_shapes_are_what_vllm_creates(llama_dir, llama_out, name):
    report = json.loads((llama_out / "fp8_report.json").read_text())["serving"][name]
    with safe_open(llama_out / "serving" / name / "model.safetensors", "pt") as served, \
            safe_open(llama_dir / "model.safetensors", "pt") as source:
        for path in report["quantized"]:
            rows, columns = source.get_tensor(f"{path}.weight").shape
            # ModelOptFp8LinearMethod / ModelOptNvFp4LinearMethod.create_weights; per-tensor scales take [] or [1]
            expected = {"weight": (torch.float8_e4m3fn, (rows, columns)), "weight_scale": (torch.float32, (1,)),
                        "input_scale": (torch.float32, (1,))} if name == FP8 else \
                {"weight": (torch.uint8, (rows, columns // 2)),
                 "weight_scale": (torch.float8_e4m3fn, (rows, columns // 16)),
                 "weight_scale_2": (torch.float32, (1,)), "input_scale": (torch.float32, (1,))}
            for suffix, (dtype, shape) in expected.items():
                tensor = served.get_tensor(f"{path}.{suffix}")
                assert (tensor.dtype, tuple(tensor.shape)) == (dtype, shape), f"{path}.{suffix}"
        for path in report["skipped"]:
            assert served.get_tensor(f"{path}.weight").dtype == torch.bfloat16
            assert f"{path}.weight_scale" not in served.keys() and f"{path}.input_scale" not in served.keys()


def test_scales_follow_modelopt_formulas_and_fused_groups_share_them(llama_dir, llama_out):
    amax = json.loads((llama_out / "fp8_report.json").read_text())["serving"][NVFP4]["input_amax"]
    with safe_open(llama_out / "serving" / FP8 / "model.safetensors", "pt") as fp8, \
            safe_open(llama_out / "serving" / NVFP4 / "model.safetensors", "pt") as fp4, \
            safe_open(llama_dir / "model.safetensors", "pt") as source:
        for group in (QKV, GATE_UP, ["model.layers.1.mlp.down_proj"]):
            weights = {path: source.get_tensor(f"{path}.weight") for path in group}
            group_amax = max(weight.float().abs().max() for weight in weights.values())
            for path, weight in weights.items():
                scale = fp8.get_tensor(f"{path}.weight_scale")
                assert scale == torch.tensor(weight.float().abs().max().item() / 448.0)  # per weight, not per group
                assert torch.equal(fp8.get_tensor(f"{path}.weight"),
                                   (weight / scale.reshape(())).to(torch.float8_e4m3fn))
                assert fp8.get_tensor(f"{path}.input_scale") == torch.tensor(amax[path]) / 448.0
                assert fp4.get_tensor(f"{path}.weight_scale_2") == group_amax / (6.0 * 448.0)  # shared by the group
                assert fp4.get_tensor(f"{path}.input_scale") == torch.tensor(amax[path]) / (6.0 * 448.0)
            assert len({amax[path] for path in group}) == 1


@pytest.mark.parametrize(("name", "floor"), [(FP8, 0.99), (NVFP4, 0.97)])
def test_the_dequantized_export_runs_close_to_the_source(llama_dir, llama_out, name, floor):
    model = load_model(llama_dir, ModelSourceOptions())
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        missing, unexpected = model.load_state_dict(dequantized_state(llama_out / "serving" / name, name),
                                                    strict=False)
        served = model(input_ids=ids).logits
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    # weights only (activations in bf16); measured 0.9991 (FP8) and 0.9908 (NVFP4) on this model
    assert cosine(served, reference) >= floor


def test_a_layer_nvfp4_cannot_store_is_refused_with_its_reason(llama_out):
    report = copy.deepcopy(json.loads((llama_out / "fp8_report.json").read_text())["analysis"])
    layer = next(layer for layer in report["layers"] if layer["path"] == "model.layers.1.mlp.gate_proj")
    layer["in_features"] = 72  # 4.5 blocks of 16
    nvfp4 = plan_serving(MODELOPT_NVFP4, report, lambda name: name)
    assert nvfp4.skipped["model.layers.1.mlp.gate_proj"] == "in_features_not_divisible_by_16_for_nvfp4"
    assert nvfp4.skipped["model.layers.1.mlp.up_proj"] == "fused_group_not_fully_eligible:model.layers.1.mlp.gate_up"
    assert "model.layers.1.mlp.gate_proj" in plan_serving(MODELOPT_FP8, report, lambda name: name).quantized
