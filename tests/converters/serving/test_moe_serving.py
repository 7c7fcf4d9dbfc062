"""MoE serving exports: each expert's on-disk matrices quantized under their own names, read back by transformers.

Fixtures are the tiny Mixtral (``experts.<e>.w1/w3/w2``) and Qwen2-MoE (``experts.<e>.gate_proj/up_proj/down_proj``)
of tests/models.py, saved with save_pretrained, so the on-disk names are the per-expert ones real checkpoints hold.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open

from converters.analysis.eligibility import analyze_model
from converters.model.checkpoint import Checkpoint
from converters.model.sources import ModelSourceOptions, build_meta_model, load_config, load_model
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.serving import serving_format
from converters.serving.selection import expert_disk_keys, select_serving
from tests.converters.model.test_moe import ON_DISK, starve_expert_in_calibration
from tests.models import MOE_CONFIGS

STATIC, DYNAMIC, BLOCK = "compressed-tensors-fp8", "compressed-tensors-fp8-dynamic", "fp8-block"
CALIBRATION = CalibrationSettings(steps=3, seq_len=24)
GATES = {"mixtral": "model.layers.{i}.block_sparse_moe.gate", "qwen2_moe": "model.layers.{i}.mlp.gate"}
EXPERTS_ON_DISK = {"mixtral": "model.layers.{i}.block_sparse_moe.experts", "qwen2_moe": "model.layers.{i}.mlp.experts"}


def convert(root, name, out, formats, **request):
    request = ConversionRequest(model=str(root / name), recipe={"backend": "te"}, serving_formats=formats,
                                **{"calibration": CALIBRATION, **request})
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(root,)))
    return json.loads((out / "fp8_report.json").read_text())


@pytest.fixture(scope="module")
def exports(moe_root):
    return {name: convert(moe_root, name, moe_root / f"{name}-out", (STATIC, DYNAMIC)) for name in MOE_CONFIGS}


def cosine(a, b):
    return float(torch.nn.functional.cosine_similarity(a.float().flatten(), b.float().flatten(), dim=0))


def served_logits(root, source, served, *, expert_input_scales=0):
    """The served model's and the source model's logits on one token batch, after a clean transformers load.

    transformers dequantizes experts and drops their ``input_scale`` (vLLM reads them): those, and only
    those, come back as unexpected keys (under transformers' in-memory names).
    """
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(served, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    unexpected = info["unexpected_keys"]
    assert len(unexpected) == expert_input_scales, unexpected
    assert all(re.search(r"\.experts\.\d+\.\w+\.input_scale$", key) for key in unexpected), unexpected
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = load_model(source, ModelSourceOptions(allowed_roots=(root,)))(input_ids=ids).logits
        return model.eval(), model(input_ids=ids).logits, reference


@pytest.mark.parametrize("fmt", [STATIC, DYNAMIC])
@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_transformers_loads_the_experts_from_their_fp8_tensors(moe_root, exports, name, fmt):
    served = moe_root / f"{name}-out" / "serving" / fmt
    model, logits, reference = served_logits(moe_root, moe_root / name, served,
                                             expert_input_scales=2 * 8 * 3 if fmt == STATIC else 0)
    assert cosine(logits, reference) >= 0.99
    experts = model.model.layers[1].mlp.experts
    with safe_open(served / "model.safetensors", "pt") as handle:
        gate, up, down = ((handle.get_tensor(f"model.layers.1.{key.format(e=3)}.weight").float()
                           * handle.get_tensor(f"model.layers.1.{key.format(e=3)}.weight_scale").float())
                          for key in ON_DISK[name])
    intermediate = gate.shape[0]
    torch.testing.assert_close(experts.gate_up_proj[3, :intermediate], gate, rtol=0, atol=0)
    torch.testing.assert_close(experts.gate_up_proj[3, intermediate:], up, rtol=0, atol=0)
    torch.testing.assert_close(experts.down_proj[3], down, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_static_expert_tensors_keep_their_names_and_follow_the_formulas(moe_root, exports, name):
    report = exports[name]
    amax = report["calibration"]["layers"]
    assert len(report["serving"][STATIC]["quantized"]) >= 2 * 8 * 2
    with safe_open(moe_root / f"{name}-out" / "serving" / STATIC / "model.safetensors", "pt") as served, \
            safe_open(moe_root / name / "model.safetensors", "pt") as source:
        assert not [key for key in served.keys() if "gate_up_proj" in key or key.endswith("experts.down_proj")]
        for layer in range(2):
            for e in range(8):
                scales = {}
                for key, gemm in zip(ON_DISK[name], ("gate_up_proj", "gate_up_proj", "down_proj"), strict=True):
                    prefix = f"model.layers.{layer}.{key.format(e=e)}"
                    weight, original = served.get_tensor(f"{prefix}.weight"), source.get_tensor(f"{prefix}.weight")
                    scale, input_scale = served.get_tensor(f"{prefix}.weight_scale"), \
                        served.get_tensor(f"{prefix}.input_scale")
                    assert weight.dtype == torch.float8_e4m3fn and weight.shape == original.shape
                    assert scale.shape == input_scale.shape == (1,)
                    assert scale == original.abs().max() / 448
                    assert torch.equal(weight, (original / scale).clamp(-448, 448).to(torch.float8_e4m3fn))
                    unit = f"model.layers.{layer}.mlp.experts.{e}.{gemm}"
                    assert input_scale == max(step[0] for step in amax[unit]["amax_forward"]) / 448
                    scales[key] = input_scale
                gate_key, up_key, _ = ON_DISK[name]
                assert torch.equal(scales[gate_key], scales[up_key])  # vLLM refuses unequal w1/w3 input scales


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_dynamic_expert_scales_are_per_channel_per_matrix(moe_root, exports, name):
    with safe_open(moe_root / f"{name}-out" / "serving" / DYNAMIC / "model.safetensors", "pt") as served, \
            safe_open(moe_root / name / "model.safetensors", "pt") as source:
        for key in ON_DISK[name]:
            prefix = f"model.layers.0.{key.format(e=6)}"
            original, scale = source.get_tensor(f"{prefix}.weight"), served.get_tensor(f"{prefix}.weight_scale")
            assert torch.equal(scale, original.abs().amax(dim=1, keepdim=True) / 448)
            assert f"{prefix}.input_scale" not in served.keys()


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_config_covers_experts_and_attention_and_ignores_routers(moe_root, exports, name):
    from compressed_tensors.quantization import QuantizationConfig
    from transformers.integrations.compressed_tensors import get_experts_scheme

    for fmt in (STATIC, DYNAMIC):
        config = json.loads((moe_root / f"{name}-out" / "serving" / fmt / "config.json").read_text())
        parsed = QuantizationConfig.model_validate(config["quantization_config"])
        assert get_experts_scheme(parsed).targets == ["Linear"]  # the group transformers and vLLM use for experts
        ignore = parsed.ignore
        assert {GATES[name].format(i=i) for i in range(2)} <= set(ignore)
        assert "model.layers.1.self_attn.q_proj" not in ignore and not [entry for entry in ignore if "experts" in entry]


def test_an_expert_without_tokens_gets_the_largest_input_scale_of_its_layer(moe_root, tmp_path, monkeypatch):
    starve_expert_in_calibration(monkeypatch, 5, 8)
    report = convert(moe_root, "mixtral", tmp_path / "out", (STATIC,),
                     calibration=CalibrationSettings(steps=3, seq_len=24, backward=True))
    amax = report["calibration"]["layers"]
    starved = [f"model.layers.{i}.mlp.experts.5.{gemm}" for i in range(2) for gemm in ("down_proj", "gate_up_proj")]
    fallback = report["serving"][STATIC]["input_amax_fallback"]
    assert sorted(fallback) == starved
    assert any("model.layers.0.mlp.experts.5.gate_up_proj" in line and "no calibration token" in line
               for line in report["warnings"])
    with safe_open(tmp_path / "out" / "serving" / STATIC / "model.safetensors", "pt") as served:
        for unit in starved:
            assert max(step[0] for step in amax[unit]["amax_forward"]) == 0
            others = [unit.replace(".5.", f".{e}.") for e in range(8) if e != 5]
            expected = max(max(step[0] for step in amax[other]["amax_forward"]) for other in others)
            assert fallback[unit] == pytest.approx(expected)
            layer, gemm = unit.split(".")[2], unit.rpartition(".")[2]
            names = ("w1", "w3") if gemm == "gate_up_proj" else ("w2",)
            for matrix in names:
                scale = served.get_tensor(f"model.layers.{layer}.block_sparse_moe.experts.5.{matrix}.input_scale")
                assert scale == torch.tensor([expected]) / 448


def test_a_partly_eligible_experts_module_stays_whole_in_high_precision(moe_root, tmp_path):
    report = convert(moe_root, "mixtral", tmp_path / "out", (STATIC,), exclude=("model.layers.1.mlp.experts.2",))
    skipped = report["serving"][STATIC]["skipped"]
    assert skipped["model.layers.1.mlp.experts.2.gate_up_proj"] == "excluded_by_pattern"
    partly = "fused_group_not_fully_eligible:model.layers.1.mlp.experts.gate_up_proj"
    assert skipped["model.layers.1.mlp.experts.0.gate_up_proj"] == skipped["model.layers.1.mlp.experts.7.down_proj"] \
        == partly
    assert "model.layers.0.mlp.experts.2.gate_up_proj" in report["serving"][STATIC]["quantized"]
    served = tmp_path / "out" / "serving" / STATIC
    with safe_open(served / "model.safetensors", "pt") as handle:
        assert handle.get_tensor("model.layers.1.block_sparse_moe.experts.0.w1.weight").dtype == torch.float32
        assert "model.layers.1.block_sparse_moe.experts.0.w1.weight_scale" not in handle.keys()
        assert handle.get_tensor("model.layers.0.block_sparse_moe.experts.0.w1.weight").dtype == torch.float8_e4m3fn
    ignore = json.loads((served / "config.json").read_text())["quantization_config"]["ignore"]
    regexes = [entry.removeprefix("re:") for entry in ignore if entry.startswith("re:")]
    # vLLM asks about a fused MoE layer through its first expert's names, with re.match
    assert any(re.match(pattern, "model.layers.1.block_sparse_moe.experts.0.gate_proj") for pattern in regexes)
    assert not any(re.match(pattern, "model.layers.0.block_sparse_moe.experts.0.gate_proj") for pattern in regexes)
    _, logits, reference = served_logits(moe_root, moe_root / "mixtral", served, expert_input_scales=8 * 3)
    assert cosine(logits, reference) >= 0.99


@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_on_disk_matrices_map_to_units_through_the_checkpoints_own_conversion(moe_root, name):
    sources = ModelSourceOptions(allowed_roots=(moe_root,))
    meta = build_meta_model(load_config(moe_root / name, sources), sources)
    report = analyze_model(meta)
    checkpoint = Checkpoint(moe_root / name, meta, dtype=torch.float32, device="cpu")
    keys = expert_disk_keys(checkpoint.mapping, checkpoint.target_of, report)
    assert len(keys) == 2 * 8 * 2
    gate, up, down = (f"model.layers.1.{key.format(e=3)}.weight" for key in ON_DISK[name])
    assert keys["model.layers.1.mlp.experts.3.gate_up_proj"] == (gate, up)
    assert keys["model.layers.1.mlp.experts.3.down_proj"] == (down,)
    # the tiny models' hidden size is 64: no whole 128x128 block, so fp8-block keeps every expert in high precision
    selection = select_serving(serving_format(BLOCK), report, checkpoint.on_disk_name, keys)
    assert not selection.experts
    assert selection.skipped["model.layers.0.mlp.experts.4.down_proj"] == "dim_not_divisible_by_128"
    not_converted = serving_format(BLOCK).quantization_config(selection)["modules_to_not_convert"]
    assert {"model.layers.0.mlp.experts", EXPERTS_ON_DISK[name].format(i=0)} <= set(not_converted)


def save_moe_128(directory):
    """A Mixtral whose expert and attention matrices hold whole 128x128 blocks."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    from converters.model.demo import build_demo_tokenizer

    tokenizer = build_demo_tokenizer()
    config = MixtralConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                           eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                           tie_word_embeddings=False, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_local_experts=4, num_experts_per_tok=2, num_attention_heads=2, num_key_value_heads=2,
                           head_dim=64)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def test_block_export_quantizes_each_expert_matrix_in_128_blocks(tmp_path):
    source = save_moe_128(tmp_path / "mixtral128")
    report = convert(tmp_path, "mixtral128", tmp_path / "out", (BLOCK,))
    assert "model.layers.1.mlp.experts.3.gate_up_proj" in report["serving"][BLOCK]["quantized"]
    served = tmp_path / "out" / "serving" / BLOCK
    with safe_open(served / "model.safetensors", "pt") as handle, \
            safe_open(source / "model.safetensors", "pt") as original:
        for matrix in ("w1", "w3", "w2"):
            key = f"model.layers.1.block_sparse_moe.experts.3.{matrix}.weight"
            weight, scale, dense = handle.get_tensor(key), handle.get_tensor(f"{key}_scale_inv"), \
                original.get_tensor(key)
            rows, columns = dense.shape
            blocks = dense.reshape(rows // 128, 128, columns // 128, 128).abs().amax(dim=(1, 3))
            assert weight.dtype == torch.float8_e4m3fn and scale.shape == (rows // 128, columns // 128) != (1, 1)
            assert torch.equal(scale, blocks / 448)
    config = json.loads((served / "config.json").read_text())["quantization_config"]
    assert {"model.layers.0.block_sparse_moe.gate", "model.layers.1.block_sparse_moe.gate"} <= \
        set(config["modules_to_not_convert"])
    _, logits, reference = served_logits(tmp_path, source, served)
    assert cosine(logits, reference) >= 0.99
