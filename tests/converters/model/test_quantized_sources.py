"""Quantized checkpoints as input: each of this repo's serving exports is detected, and every quantized weight
dequantizes to the same bits as the reference library's own dequantizer (transformers' FineGrainedFP8 for
fp8-block, compressed-tensors' decompressors for its formats, ModelOpt's NVFP4QTensor formula for ModelOpt)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from converters.analysis.eligibility import analyze_model_reference
from converters.errors import ModelConfigError
from converters.model.quantized import Scheme, checkpoint_tensor_names, source_quantization
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from tests.modelopt_venv import modelopt_python

FORMATS = {
    "fp8-block": Scheme.FP8_BLOCK,
    "compressed-tensors-fp8": Scheme.CT_FP8,
    "compressed-tensors-fp8-dynamic": Scheme.CT_FP8,
    "nvfp4": Scheme.CT_NVFP4,
    "mxfp8": Scheme.CT_MXFP8,
    "modelopt-fp8": Scheme.MODELOPT_FP8,
    "modelopt-nvfp4": Scheme.MODELOPT_NVFP4,
}
#: ModelOpt's NVFP4QTensor.e2m1_values (modelopt/torch/quantization/qtensor/nvfp4_tensor.py), default dtype fp32
MODELOPT_E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])


@pytest.fixture(scope="module")
def exports(llama_dir):
    out = llama_dir.parent / "out"
    request = ConversionRequest(model=str(llama_dir), recipe={"backend": "te"},
                                calibration=CalibrationSettings(steps=3, seq_len=32),
                                serving_formats=tuple(FORMATS))
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(llama_dir.parent,)))
    return out / "serving"


def tensors_of(directory):
    return tensors_of_file(directory / "model.safetensors")


def tensors_of_file(path):
    with safe_open(str(path), "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 (safe_open has no iter)


def bits(tensor):
    """The tensor's bytes as integers: equal bits, -0.0 told from +0.0 and NaN from NaN."""
    return tensor.contiguous().view({2: torch.int16, 4: torch.int32}[tensor.element_size()])


def reference_dequantize(name, directory, tensors, weight_key):
    """The reference library's own dequantization of ``weight_key`` in the export ``name`` (bf16)."""
    prefix = weight_key.removesuffix("weight")
    if name == "fp8-block":
        from transformers.integrations.finegrained_fp8 import Fp8Dequantize

        return Fp8Dequantize(None)._dequantize_one(tensors[weight_key], tensors[f"{weight_key}_scale_inv"],
                                                   output_dtype=torch.bfloat16)
    if name.startswith("modelopt"):
        return modelopt_dequantize(name, tensors, prefix)
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(
        json.loads((directory / "config.json").read_text())["quantization_config"])
    scheme = config.config_groups["group_0"]
    compressor = BaseCompressor.get_value_from_registry(config.format)
    local = {key.removeprefix(prefix): value for key, value in tensors.items() if key.startswith(prefix)
             and "." not in key.removeprefix(prefix)}
    return compressor.decompress(local, scheme)["weight"]


def modelopt_dequantize(name, tensors, prefix):
    """ModelOpt's dequantization: NVFP4QTensor.dequantize (nvidia-modelopt, qtensor/nvfp4_tensor.py, the non-fast
    path: fp32 E2M1 lookup times ``scale.to(fp32) * double_scale``, then ``.to(dtype)``); FP8 as vLLM applies it
    (fp32 weight scale on the fp32 GEMM output): ``fp32(w) * weight_scale``, then bf16."""
    weight, scale = tensors[f"{prefix}weight"], tensors[f"{prefix}weight_scale"]
    if name == "modelopt-fp8":
        return (weight.to(torch.float32) * scale).to(torch.bfloat16)
    unpacked = torch.empty((*weight.shape[:-1], weight.shape[-1] * 2), dtype=torch.bfloat16)
    unpacked[..., 1::2] = weight >> 4
    unpacked[..., 0::2] = weight & 0x0F
    values = MODELOPT_E2M1[unpacked.reshape(-1).long()].reshape(unpacked.shape)
    per_block_scale = scale.to(torch.float32) * tensors[f"{prefix}weight_scale_2"]
    return (values.view(*values.shape[:-1], -1, 16) * per_block_scale.unsqueeze(-1)).reshape(values.shape).to(
        torch.bfloat16)


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_export_is_detected_with_its_scheme(exports, name):
    quantization = source_quantization(exports / name)
    assert quantization is not None and quantization.scheme is FORMATS[name]
    described = quantization.describe(checkpoint_tensor_names(exports / name))
    assert described["scheme"] == FORMATS[name].value
    assert described["quantized_modules"], described
    if name == "fp8-block":
        assert described["block_size"] == [128, 128]
        # k/v (64 rows) cannot hold whole 128x128 blocks: the config and the tensors agree they stay bf16
        assert "model.layers.1.self_attn.k_proj" in described["not_converted"]
        assert "model.layers.1.self_attn.k_proj.weight" in described["unquantized_weights"]
    if name in ("nvfp4", "modelopt-nvfp4"):
        assert described["group_size"] == 16


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_quantized_weight_dequantizes_to_the_reference_bits(exports, llama_dir, name):
    directory = exports / name
    quantization = source_quantization(directory)
    tensors = tensors_of(directory)
    source = tensors_of(llama_dir)
    keys = quantization.quantized_weights(set(tensors))
    assert keys
    for key in keys:
        ours = quantization.dequantize(key, tensors.__getitem__)
        reference = reference_dequantize(name, directory, tensors, key)
        assert ours.dtype == reference.dtype == torch.bfloat16, key
        assert ours.shape == source[key].shape == quantization.logical_shape(key, tensors), key
        assert torch.equal(bits(ours), bits(reference)), key
        # and it is the model again, up to the format's quantization error
        error = (ours.float() - source[key].float()).norm() / source[key].float().norm()
        assert error < (0.2 if "nvfp4" in name else 0.08), (key, float(error))


@pytest.mark.filterwarnings("ignore:You passed `quantization_config`")
@pytest.mark.parametrize("name", [name for name in FORMATS if not name.startswith("modelopt")])
def test_transformers_loading_the_export_dequantized_holds_the_same_bits(exports, name):
    """End to end through transformers 5.24: ``FineGrainedFP8Config(dequantize=True)`` for fp8-block, the
    compressed-tensors integration with ``dequantize=True`` for the others (transformers has no ModelOpt reader)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig, FineGrainedFP8Config

    directory = exports / name
    config = FineGrainedFP8Config(dequantize=True) if name == "fp8-block" else CompressedTensorsConfig(
        dequantize=True)
    loaded = AutoModelForCausalLM.from_pretrained(directory, quantization_config=config,
                                                  dtype=torch.bfloat16).state_dict()
    quantization = source_quantization(directory)
    tensors = tensors_of(directory)
    for key in quantization.quantized_weights(set(tensors)):
        assert loaded[key].dtype == torch.bfloat16
        assert torch.equal(bits(quantization.dequantize(key, tensors.__getitem__)), bits(loaded[key])), key


def test_modelopt_fp8_differs_from_modelopt_own_bf16_dequantize_by_at_most_one_ulp(exports):
    """ModelOpt's ``FP8QTensor.dequantize(dtype)`` is ``w.to(dtype) * scale.to(dtype)``: in fp32 it is ours bit for
    bit; in bf16 it rounds the fp32 scale to bf16 before multiplying. Ours multiplies by the fp32 scale, as vLLM's
    GEMM applies it, and rounds the product: one bf16 ulp apart where the two roundings differ."""
    directory = exports / "modelopt-fp8"
    quantization = source_quantization(directory)
    tensors = tensors_of(directory)
    differing = total = 0
    for key in quantization.quantized_weights(set(tensors)):
        weight, scale = tensors[key], tensors[key.removesuffix("weight") + "weight_scale"]
        fp32 = quantization.dequantize(key, tensors.__getitem__, dtype=torch.float32)
        assert torch.equal(bits(fp32), bits(weight.to(torch.float32) * scale.to(torch.float32))), key
        ulps = (bits(quantization.dequantize(key, tensors.__getitem__)).int()
                - bits(weight.to(torch.bfloat16) * scale.to(torch.bfloat16)).int()).abs()
        assert int(ulps.max()) <= 1, key
        differing, total = differing + int((ulps > 0).sum()), total + ulps.numel()
    assert 0 < differing < total / 2


#: run in ModelOpt's venv: each quantized weight of the export in argv[1] dequantized to fp32 by nvidia-modelopt's own
#: FP8QTensor / NVFP4QTensor (the classes its export and its HF loader use), saved to argv[2]
MODELOPT_DEQUANTIZE = """
import sys
from safetensors.torch import load_file, save_file
import torch
from modelopt.torch.quantization.qtensor import FP8QTensor, NVFP4QTensor
for directory, into in zip(sys.argv[1::2], sys.argv[2::2]):
    tensors, out = load_file(directory + "/model.safetensors"), {}
    for key, weight in tensors.items():
        prefix = key.removesuffix("weight")
        if not key.endswith("weight") or prefix + "weight_scale" not in tensors:
            continue
        scale = tensors[prefix + "weight_scale"]
        if prefix + "weight_scale_2" in tensors:
            shape = (*weight.shape[:-1], weight.shape[-1] * 2)
            out[key] = NVFP4QTensor(shape, torch.float32, weight).dequantize(
                torch.float32, scale=scale, double_scale=tensors[prefix + "weight_scale_2"], block_sizes={-1: 16})
        else:
            out[key] = FP8QTensor(weight.shape, torch.float32, weight).dequantize(torch.float32, scale=scale)
    save_file(out, into)
"""


@pytest.fixture(scope="module")
def modelopt_dequantized(exports, tmp_path_factory):
    """Each ModelOpt export -> the file of its weights as MODELOPT_DEQUANTIZE reads them: one process of ModelOpt's
    venv for both (its import is most of the cost)."""
    python = modelopt_python()
    names = ("modelopt-fp8", "modelopt-nvfp4")
    into = tmp_path_factory.mktemp("modelopt-dequantized")
    pairs = [str(path) for name in names for path in (exports / name, into / f"{name}.safetensors")]
    subprocess.run([str(python), "-c", MODELOPT_DEQUANTIZE, *pairs], check=True, capture_output=True, timeout=600)
    return {name: into / f"{name}.safetensors" for name in names}


@pytest.mark.parametrize("name", ["modelopt-fp8", "modelopt-nvfp4"])
def test_modelopt_own_dequantization_gives_our_fp32_bits(exports, modelopt_dequantized, name):
    """nvidia-modelopt's own qtensor classes, run in its venv, read every quantized weight of our ModelOpt export to
    the same fp32 bits as our reader: modelopt_dequantize above transcribes them, this runs them."""
    directory = exports / name
    theirs = tensors_of_file(modelopt_dequantized[name])
    quantization = source_quantization(directory)
    tensors = tensors_of(directory)
    keys = quantization.quantized_weights(set(tensors))
    assert sorted(theirs) == sorted(keys)
    for key in keys:
        ours = quantization.dequantize(key, tensors.__getitem__, dtype=torch.float32)
        assert torch.equal(bits(ours), bits(theirs[key])), key


@pytest.mark.parametrize("name", ["fp8-block", "nvfp4", "modelopt-nvfp4"])
def test_fp32_output_is_the_reference_arithmetic_before_its_last_rounding(exports, name):
    """With ``dtype=torch.float32`` nothing is rounded to bf16: transformers' ``_dequantize_one`` with an fp32
    output dtype, ModelOpt's fp32 NVFP4 dequantization; compressed-tensors' NVFP4 product before its bf16 cast."""
    directory = exports / name
    quantization = source_quantization(directory)
    tensors = tensors_of(directory)
    for key in quantization.quantized_weights(set(tensors)):
        ours = quantization.dequantize(key, tensors.__getitem__, dtype=torch.float32)
        assert ours.dtype == torch.float32
        assert torch.equal(bits(ours.to(torch.bfloat16)), bits(reference_dequantize(name, directory, tensors, key)))
        if name == "fp8-block":
            from transformers.integrations.finegrained_fp8 import Fp8Dequantize

            reference = Fp8Dequantize(None)._dequantize_one(tensors[key], tensors[f"{key}_scale_inv"],
                                                            output_dtype=torch.float32)
            assert torch.equal(bits(ours), bits(reference)), key


@pytest.mark.parametrize("name", list(FORMATS))
def test_unquantized_tensors_are_the_source_tensors_and_not_taken_for_quantized(exports, llama_dir, name):
    quantization = source_quantization(exports / name)
    tensors = tensors_of(exports / name)
    source = tensors_of(llama_dir)
    quantized = quantization.quantized_weights(set(tensors))
    belonging = {companion for key in quantized for companion in quantization.companion_keys(key)}
    belonging |= set(quantized) | set(quantization.kv_cache_keys(tensors))
    assert belonging >= set(tensors) - set(source), "every extra tensor belongs to a quantized weight"
    untouched = [key for key in tensors if key not in belonging]
    assert "model.embed_tokens.weight" in untouched and "model.norm.weight" in untouched
    for key in untouched:
        assert not quantization.is_quantized(key, tensors), key
        assert torch.equal(bits(tensors[key]), bits(source[key])), key


def test_the_companions_of_an_nvfp4_weight_replace_it(exports):
    quantization = source_quantization(exports / "nvfp4")
    tensors = tensors_of(exports / "nvfp4")
    key = "model.layers.1.mlp.down_proj.weight"
    assert key not in tensors and quantization.is_quantized(key, tensors)
    present = [name for name in quantization.companion_keys(key) if name in tensors]
    assert present == ["model.layers.1.mlp.down_proj.weight_packed", "model.layers.1.mlp.down_proj.weight_scale",
                       "model.layers.1.mlp.down_proj.weight_global_scale",
                       "model.layers.1.mlp.down_proj.input_global_scale"]
    assert quantization.logical_shape(key, tensors) == (128, 256)


def write_checkpoint(directory, quantization_config, tensors):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama",
                                                       "quantization_config": quantization_config}))
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


def test_fp8_blocks_with_partial_edges_follow_the_block_grid(tmp_path):
    """transformers derives the block from the shapes (wrong for partial edge blocks); the grid of
    ``weight_block_size`` is DeepSeek-V3's and vLLM's reading: element (r, c) takes scale (r // 128, c // 128)."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(200, 300, generator=generator) * 100).to(torch.float8_e4m3fn)
    scale = torch.rand(2, 3, generator=generator) + 0.01
    directory = write_checkpoint(tmp_path / "ckpt", {"quant_method": "fp8", "weight_block_size": [128, 128]},
                                 {"a.weight": weight, "a.weight_scale_inv": scale})
    quantization = source_quantization(directory)
    ours = quantization.dequantize("a.weight", {"a.weight": weight, "a.weight_scale_inv": scale}.__getitem__)
    rows = torch.arange(200).unsqueeze(1) // 128
    cols = torch.arange(300).unsqueeze(0) // 128
    expected = (weight.float() * scale[rows, cols]).to(torch.bfloat16)
    assert torch.equal(bits(ours), bits(expected))


@pytest.mark.parametrize("strategy,scale_shape,block", [
    ("block", (2, 3), [128, 128]),  # partial edge blocks: compressed-tensors pads, then crops
    ("group", (200, 10), None),
    ("channel", (200, 1), None),
    ("tensor", (1,), None),
])
def test_compressed_tensors_fp8_strategies_match_its_decompressor(tmp_path, strategy, scale_shape, block):
    from compressed_tensors.compressors import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strategy, "dynamic": False,
               "group_size": 32 if strategy == "group" else None, "block_structure": block}
    group = {"targets": ["Linear"], "weights": weights,
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}
    generator = torch.Generator().manual_seed(1)
    dense = torch.randn(200, 320, generator=generator, dtype=torch.bfloat16)
    scale = (torch.rand(scale_shape, generator=generator) * 0.01 + 1e-3).to(torch.bfloat16)
    scheme = QuantizationScheme.model_validate(group)
    compressed = FloatQuantizationCompressor.compress({"weight": dense, "weight_scale": scale}, scheme)
    directory = write_checkpoint(tmp_path / "ckpt", {
        "quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": group}, "ignore": ["lm_head"]},
        {f"a.{key}": value.contiguous() for key, value in compressed.items()})
    quantization = source_quantization(directory)
    assert quantization.scheme is Scheme.CT_FP8
    tensors = tensors_of(directory)
    ours = quantization.dequantize("a.weight", tensors.__getitem__)
    reference = FloatQuantizationCompressor.decompress({"weight": tensors["a.weight"],
                                                        "weight_scale": tensors["a.weight_scale"]}, scheme)["weight"]
    assert reference.dtype == torch.bfloat16
    assert torch.equal(bits(ours), bits(reference))


def test_a_mixed_precision_checkpoint_dequantizes_each_module_with_its_own_format(tmp_path):
    """compressed-tensors ``mixed-precision``: an NVFP4 group and an FP8 group, compressed by compressed-tensors."""
    from compressed_tensors.compressors import FloatQuantizationCompressor, NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme

    fp8 = {"targets": ["re:.*fp8$"], "format": "float-quantized",
           "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False}}
    fp4 = {"targets": ["re:.*fp4$"], "format": "nvfp4-pack-quantized",
           "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "tensor_group",
                       "group_size": 16, "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}}
    generator = torch.Generator().manual_seed(2)
    dense = torch.randn(64, 128, generator=generator, dtype=torch.bfloat16)
    fp8_parts = FloatQuantizationCompressor.compress(
        {"weight": dense, "weight_scale": dense.abs().amax(1, keepdim=True) / 448}, QuantizationScheme(**fp8))
    global_scale = torch.tensor([448 * 6 / float(dense.abs().max())])
    block_scale = (dense.float().unflatten(-1, (8, 16)).abs().amax(-1) / 6 * global_scale).to(
        torch.float8_e4m3fn).to(torch.bfloat16)  # compressed-tensors takes the scale in float and stores it in E4M3
    fp4_parts = NVFP4PackedCompressor.compress({"weight": dense, "weight_scale": block_scale,
                                                "weight_global_scale": global_scale}, QuantizationScheme(**fp4))
    tensors = {**{f"a.fp8.{key}": value for key, value in fp8_parts.items()},
               **{f"a.fp4.{key}": value for key, value in fp4_parts.items()}}
    directory = write_checkpoint(tmp_path / "ckpt", {
        "quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
        "config_groups": {"group_0": fp8, "group_1": fp4}}, tensors)
    quantization = source_quantization(directory)
    assert quantization.scheme is Scheme.CT_MIXED
    assert quantization.quantized_weights(set(tensors)) == ["a.fp4.weight", "a.fp8.weight"]
    assert quantization.logical_shape("a.fp4.weight", tensors) == (64, 128)
    assert quantization.logical_shape("a.fp8.weight", tensors) == (64, 128)
    for key, compressor, group in (("a.fp8.weight", FloatQuantizationCompressor, fp8),
                                   ("a.fp4.weight", NVFP4PackedCompressor, fp4)):
        local = {name.removeprefix(key.removesuffix("weight")): value for name, value in tensors.items()
                 if name.startswith(key.removesuffix("weight"))}
        reference = compressor.decompress(local, QuantizationScheme(**group))["weight"]
        assert torch.equal(bits(quantization.dequantize(key, tensors.__getitem__)), bits(reference)), key


def test_every_mx_exponent_dequantizes_as_compressed_tensors_does():
    """All 255 finite E8M0 exponents (2**-127 .. 2**127) times every E4M3 code, against MXFP8's decompressor."""
    from compressed_tensors.compressors import MXFP8QuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    from converters.model.quantized import SourceQuantization, dequantize_fp8

    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    codes = codes[~codes.float().isnan()]
    weight = codes.repeat(255, 16).contiguous()  # [255, 4064]: 127 groups of 32 a row
    exponents = torch.arange(255, dtype=torch.uint8).unsqueeze(1).expand(255, 4064 // 32).contiguous()
    args = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
            "dynamic": False, "scale_dtype": "torch.uint8"}
    scheme = QuantizationScheme.model_validate({"targets": ["Linear"], "weights": args})
    reference = MXFP8QuantizationCompressor.decompress({"weight": weight, "weight_scale": exponents}, scheme)["weight"]
    ours = dequantize_fp8(weight, exponents, torch.bfloat16)  # the arithmetic CT_MXFP8's reader applies
    assert torch.equal(bits(ours), bits(reference))
    # the largest exponents overflow bf16 (448 * 2**127): the source's reader refuses such a weight, naming it
    quantization = SourceQuantization(scheme=Scheme.CT_MXFP8, quant_method="compressed-tensors", group_size=32)
    with pytest.raises(ModelConfigError, match="a.weight .*NaN or infinite"):
        quantization.dequantize("a.weight", {"a.weight": weight, "a.weight_scale": exponents}.__getitem__)


@pytest.mark.parametrize("config,named", [
    ({"quant_method": "awq", "bits": 4}, "'awq'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}},
     "'pack-quantized'"),
    ({"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}, "'W4A8_AWQ'"),
])
def test_a_quantization_it_cannot_read_is_refused_naming_it(tmp_path, config, named):
    directory = write_checkpoint(tmp_path / "ckpt", config, {"a.weight": torch.zeros(2, 2)})
    with pytest.raises(ModelConfigError) as caught:
        source_quantization(directory)
    assert caught.value.field == "model"
    assert named in caught.value.message
    assert "compressed-tensors" in caught.value.message and "NVFP4" in caught.value.message


def test_a_high_precision_checkpoint_has_no_source_quantization(llama_dir):
    assert source_quantization(llama_dir) is None


@pytest.mark.parametrize("name", ["fp8-block", "nvfp4", "modelopt-nvfp4"])
def test_analyze_reports_the_source_quantization(exports, name):
    directory = exports / name
    report = analyze_model_reference(str(directory), ModelSourceOptions(allowed_roots=(exports,)))
    block = report["source_quantization"]
    assert block["scheme"] == FORMATS[name].value
    assert "model.layers.1.mlp.down_proj" in block["quantized_modules"]
    assert any(layer["path"] == "model.layers.1.mlp.down_proj" for layer in report["layers"])


def test_fp8forge_analyze_json_carries_the_source_quantization(exports, capsys):
    from service.cli.main import main

    assert main(["analyze", str(exports / "modelopt-fp8"), "--allow-root", str(exports), "--json"]) == 0
    block = json.loads(capsys.readouterr().out)["source_quantization"]
    assert block["scheme"] == "modelopt-fp8" and block["quant_algo"] == "FP8"
    assert block["config_file"] == "hf_quant_config.json"
    assert "model.layers.0.self_attn.q_proj" in block["not_converted"]
    assert "model.layers.0.self_attn.q_proj.weight" in block["unquantized_weights"]


def test_analyze_of_an_unreadable_quantization_says_why_and_still_analyzes(tmp_path, llama_dir):
    directory = tmp_path / "awq"
    directory.mkdir()
    config = json.loads((llama_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (directory / "config.json").write_text(json.dumps(config))
    report = analyze_model_reference(str(directory), ModelSourceOptions(allowed_roots=(tmp_path,)))
    assert report["source_quantization"]["scheme"] is None
    assert "'awq'" in report["source_quantization"]["refused"]
    assert report["layers"]


@pytest.mark.parametrize("rows,scale_rows", [(192, 2), (576, 5)])
def test_transformers_misreads_partial_fp8_blocks(rows, scale_rows):
    """DeepSeek-V3's own kv_a_proj_with_mqa is 576 rows: 4.5 blocks of 128, a scale grid of 5 rows. transformers
    5.24's ``Fp8Dequantize`` derives the block from the shapes instead of ``weight_block_size``: it refuses 576 / 5
    and reads 192 / 2 as blocks of 96 rows. Ours is the grid of ``weight_block_size`` (DeepSeek's ``weight_dequant``,
    vLLM), so on such a weight transformers cannot be the reference; the fixtures keep whole blocks where they
    compare with it."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from converters.model.quantized import SourceQuantization

    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(rows, 256, generator=generator) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_rows, 2, generator=generator) + 0.5
    ours = SourceQuantization(scheme=Scheme.FP8_BLOCK, quant_method="fp8", block_size=(128, 128)).dequantize(
        "a.weight", {"a.weight": weight, "a.weight_scale_inv": scale}.__getitem__)
    grid = scale[torch.arange(rows).unsqueeze(1) // 128, torch.arange(256).unsqueeze(0) // 128]
    assert torch.equal(bits(ours), bits((weight.float() * grid).to(torch.bfloat16)))
    if rows % scale_rows:
        with pytest.raises(ValueError, match="not divisible by scale grid"):
            Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.bfloat16)
    else:
        theirs = Fp8Dequantize(None)._dequantize_one(weight, scale, output_dtype=torch.bfloat16)
        assert not torch.equal(bits(ours), bits(theirs))
        assert torch.equal(bits(ours[:96]), bits(theirs[:96]))  # the first 96 rows: block row 0 in both readings


@pytest.mark.parametrize("weight_shape,scale_shape,block", [
    ((200, 300), (2, 3), (128, 128)),  # block grid, partial last row and column
    ((3, 256, 384), (3, 2, 3), (128, 128)),  # stacked experts
    ((200, 320), (200, 10), None),  # groups along the columns
    ((200, 320), (200, 1), None),  # per channel
    ((200, 320), (200,), None),  # per channel, one dim
])
def test_row_chunks_give_the_bits_of_one_pass(monkeypatch, weight_shape, scale_shape, block):
    """Large weights are dequantized a few rows at a time (bounded fp32 intermediates): same bits as one pass."""
    from converters.model.quantized import arithmetic

    generator = torch.Generator().manual_seed(4)
    weight = (torch.randn(weight_shape, generator=generator) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(scale_shape, generator=generator) + 0.5
    whole = arithmetic.dequantize_fp8(weight, scale, torch.bfloat16, block)
    one_pass = (weight.float() * arithmetic.expand_scale(scale, weight.shape, block)).to(torch.bfloat16)
    assert torch.equal(bits(whole), bits(one_pass))
    monkeypatch.setattr(arithmetic, "_CHUNK_ELEMENTS", 4096)  # chunks of 128 rows (blocks) or 12 rows
    assert arithmetic._chunk_rows(weight, block) < weight_shape[-2]
    assert torch.equal(bits(arithmetic.dequantize_fp8(weight, scale, torch.bfloat16, block)), bits(one_pass))


def test_the_prefetch_of_a_quantized_source_reads_and_dequantizes_its_weights(exports):
    """A quantized source's next layer is read and dequantized in the prefetch (the work is off the forward's
    thread), the tensors a plain ``read`` gives; a plain source's goes to the kernel's readahead (nothing read)."""
    from converters.model.checkpoint import Checkpoint, unit_keys
    from converters.model.sources import build_meta_model, load_config

    for directory, quantized in ((exports / "compressed-tensors-fp8", True), (exports.parent, False)):
        sources = ModelSourceOptions(allowed_roots=(directory.parent,))
        meta = build_meta_model(load_config(directory, sources), sources)
        checkpoint = Checkpoint(directory, meta, dtype=torch.bfloat16, device="cpu")
        keys = unit_keys(meta, lambda name: name.startswith("model.layers.0."))
        ahead = checkpoint.read_ahead(keys)
        if not quantized:
            assert ahead is None
            continue
        read = checkpoint.read(keys)
        assert ahead.keys() == read.keys() and any(key.endswith("q_proj.weight") for key in ahead)
        assert all(torch.equal(bits(ahead[key]), bits(read[key])) for key in read)
