"""ModelOpt unified HF checkpoints: the files, names, dtypes and shapes vLLM's modelopt loader reads, and scales
that follow ModelOpt's formulas."""

from __future__ import annotations

import copy
import json
import re
import subprocess

import pytest
import torch
from safetensors import safe_open

from converters.model.sources import ModelSourceOptions, load_model
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.serving import select_serving
from converters.serving.modelopt import MODELOPT_FP8, MODELOPT_NVFP4
from tests.converters.calibration.test_kv_cache_scales import CALIBRATION as KV_CALIBRATION
from tests.converters.calibration.test_kv_cache_scales import _batches, independent_amax
from tests.converters.serving.exports import cosine, export
from tests.modelopt_venv import modelopt_python
from tests.models import save_tiny_model

FP8, NVFP4 = "modelopt-fp8", "modelopt-nvfp4"
CALIBRATION = CalibrationSettings(steps=3, seq_len=32)
QKV = [f"model.layers.1.self_attn.{name}_proj" for name in "qkv"]
GATE_UP = ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
#: the names vLLM's maybe_remap_kv_scale_name lists as ModelOpt's (``modelopt_scale_names``)
MODELOPT_KV_NAME = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_proj\.([kv])_scale$")


@pytest.fixture(scope="module")
def llama_out(llama_dir):
    return export(llama_dir, (FP8, NVFP4), calibration=CALIBRATION)


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
            # per-tensor scales [] as ModelOpt 0.47.0's export writes them (vLLM also takes [1])
            expected = {"weight": (torch.float8_e4m3fn, (rows, columns)), "weight_scale": (torch.float32, ()),
                        "input_scale": (torch.float32, ())} if name == FP8 else \
                {"weight": (torch.uint8, (rows, columns // 2)),
                 "weight_scale": (torch.float8_e4m3fn, (rows, columns // 16)),
                 "weight_scale_2": (torch.float32, ()), "input_scale": (torch.float32, ())}
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
    nvfp4 = select_serving(MODELOPT_NVFP4, report, lambda name: name)
    assert nvfp4.skipped["model.layers.1.mlp.gate_proj"] == "in_features_not_divisible_by_16_for_nvfp4"
    assert nvfp4.skipped["model.layers.1.mlp.up_proj"] == "fused_group_not_fully_eligible:model.layers.1.mlp.gate_up"
    assert "model.layers.1.mlp.gate_proj" in select_serving(MODELOPT_FP8, report, lambda name: name).quantized


@pytest.fixture(scope="module")
def kv_root(tmp_path_factory):
    """A tiny GQA llama (4 query heads, 2 KV heads) converted once to both ModelOpt formats with kv_cache fp8."""
    root = tmp_path_factory.mktemp("modelopt-kv")
    save_tiny_model("llama", root / "llama")
    request = ConversionRequest(model=str(root / "llama"), recipe={"backend": "ao"}, calibration=KV_CALIBRATION,
                                serving_formats=(FP8, NVFP4), kv_cache="fp8")
    run_conversion(request, root / "out", ModelSourceOptions(allowed_roots=(root,)))
    return root


def _tensors(directory):
    tensors = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


@pytest.mark.parametrize("name", [FP8, NVFP4])
def test_kv_scales_have_modelopt_names_and_amax_over_448_in_float32(kv_root, name):
    sources = ModelSourceOptions(allowed_roots=(kv_root,))
    model = load_model(kv_root / "llama", sources)
    expected = independent_amax(model, _batches(kv_root / "llama", model))  # hooks and RoPE written out, no recorder
    layers = model.config.num_hidden_layers
    assert sorted(expected) == [f"model.layers.{i}.self_attn" for i in range(layers)]

    tensors = _tensors(kv_root / "out" / "serving" / name)
    searched = json.loads((kv_root / "out" / "fp8_report.json").read_text())["serving"][name]["kv_cache"]["layers"]
    scales = {key: value for key, value in tensors.items() if key.endswith(("k_scale", "v_scale"))}
    assert sorted(scales) == sorted(f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"
                                    for i in range(layers) for kv in "kv")
    for key, value in scales.items():
        index, kv, same = MODELOPT_KV_NAME.match(key).groups()
        assert kv == same
        amax = expected[f"model.layers.{index}.self_attn"][0 if kv == "k" else 1].max()
        ratio = torch.tensor(searched[f"model.layers.{index}.self_attn"][f"{kv}_clip_ratio"])  # fp8forge's clipping
        # ModelOpt 0.47.0 postprocess_state_dict: k_bmm_quantizer._amax (fp32, 0-dim) .float() / 448, no clamp
        want = amax.float().reshape(()) * ratio / 448
        assert (value.dtype, tuple(value.shape)) == (torch.float32, ())
        assert torch.equal(value, want), (key, value, want)  # bit for bit
        assert 0 < value.item() < 1  # unclamped: this model's amax is far below 448
    assert not any(key.endswith(("self_attn.k_scale", "self_attn.v_scale")) for key in tensors)

    report = json.loads((kv_root / "out" / "fp8_report.json").read_text())["serving"][name]["kv_cache"]
    assert report["convention"] == "modelopt" and report["scale_dtype"] == "float32"


@pytest.mark.parametrize(("name", "algo"), [(FP8, "FP8"), (NVFP4, "NVFP4")])
def test_kv_cache_quant_algo_is_declared_as_modelopt_writes_it(kv_root, name, algo):
    directory = kv_root / "out" / "serving" / name
    hf = json.loads((directory / "hf_quant_config.json").read_text())["quantization"]
    assert hf["quant_algo"] == algo and hf["kv_cache_quant_algo"] == "FP8"
    assert list(hf)[:2] == ["quant_algo", "kv_cache_quant_algo"]
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    # convert_hf_quant_config_format turns kv_cache_quant_algo "FP8" into kv_cache_scheme, right after quant_algo
    assert config["kv_cache_scheme"] == {"dynamic": False, "num_bits": 8, "type": "float"}
    assert list(config) == ["config_groups", "ignore", "quant_algo", "kv_cache_scheme", "producer", "quant_method"]
    assert "kv_cache_quant_algo" not in config
    # every per-tensor scale is 0-dim, as ModelOpt writes it
    for key, value in _tensors(directory).items():
        if key.endswith(("input_scale", "weight_scale_2", "k_scale", "v_scale")) or (
                key.endswith("weight_scale") and name == FP8):
            assert tuple(value.shape) == () and value.dtype == torch.float32, key


@pytest.fixture(scope="module")
def modelopt_configs(kv_root, llama_out):
    """Each ModelOpt export's directory, with and without KV scales -> the config.json block ModelOpt's own
    convert_hf_quant_config_format makes of its hf_quant_config.json: one process of ModelOpt's venv for all."""
    python = modelopt_python()  # nvidia-modelopt in its own venv (its transformers differs from this project's)
    script = ("import json, sys\n"
              "from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format\n"
              "for directory in sys.argv[1:]:\n"
              "    with open(directory + '/hf_quant_config.json') as f:\n"
              "        print(json.dumps(convert_hf_quant_config_format(json.load(f))))\n")
    roots = (kv_root / "out" / "serving", llama_out / "serving")
    directories = [root / name for name in (FP8, NVFP4) for root in roots]
    done = subprocess.run([str(python), "-c", script, *map(str, directories)], capture_output=True,
                          text=True, timeout=600, check=True)
    converted = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(converted) == len(directories)
    return dict(zip(directories, converted, strict=True))


@pytest.mark.parametrize("name", [FP8, NVFP4])
def test_modelopt_derives_our_config_json_from_our_hf_quant_config(kv_root, llama_out, modelopt_configs, name):
    """ModelOpt's own convert_hf_quant_config_format, run on our hf_quant_config.json, gives our config.json block."""
    for directory in (kv_root / "out" / "serving" / name, llama_out / "serving" / name):  # with and without KV
        theirs = modelopt_configs[directory]
        ours = json.loads((directory / "config.json").read_text())["quantization_config"]
        assert ours == theirs and list(ours) == list(theirs), directory
