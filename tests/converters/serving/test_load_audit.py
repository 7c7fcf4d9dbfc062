"""The load audit: real serving exports pass it, and each deliberately broken export trips exactly its rule.

Exports come from run_conversion (the tiny Llama, and the tiny Mixtral and Qwen2-MoE of tests/models.py);
each breaking test copies one into tmp_path and rewrites its safetensors file or config.json.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import SERVING_FORMAT_NAMES, CalibrationSettings, ConversionRequest
from converters.serving.audit import Rule, audit_export
from tests.models import MOE_CONFIGS

STATIC, DYNAMIC, BLOCK = "compressed-tensors-fp8", "compressed-tensors-fp8-dynamic", "fp8-block"
AUDITED = (STATIC, DYNAMIC, BLOCK, "fp8-block-ue8m0")
NOT_AUDITED = tuple(name for name in SERVING_FORMAT_NAMES if name not in AUDITED)  # nvfp4, mxfp8, ModelOpt
CALIBRATION = CalibrationSettings(steps=2, seq_len=16)
LAYER0_QKV = [f"model.layers.0.self_attn.{name}_proj" for name in "qkv"]


@pytest.fixture(scope="module")
def llama_out(llama_root):
    out = llama_root / "audit-out"
    request = ConversionRequest(model=str(llama_root / "llama"), recipe={"backend": "te"}, calibration=CALIBRATION,
                                serving_formats=SERVING_FORMAT_NAMES, kv_cache="fp8")
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(llama_root,)))
    return out / "serving"


@pytest.fixture(scope="module")
def moe_out(moe_root):
    for name in MOE_CONFIGS:
        request = ConversionRequest(model=str(moe_root / name), recipe={"backend": "te"}, calibration=CALIBRATION,
                                    serving_formats=(STATIC, DYNAMIC))
        run_conversion(request, moe_root / f"{name}-audit", ModelSourceOptions(allowed_roots=(moe_root,)))
    return {name: moe_root / f"{name}-audit" / "serving" for name in MOE_CONFIGS}


def copy(export, tmp_path):
    return shutil.copytree(export, tmp_path / export.name)


def rewrite_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def rewrite_config(directory, edit):
    config = json.loads((directory / "config.json").read_text())
    edit(config["quantization_config"])
    (directory / "config.json").write_text(json.dumps(config))


def fired(result):
    return {(problem.rule, problem.name) for problem in result.problems}


@pytest.mark.parametrize("fmt", AUDITED)
def test_llama_exports_pass(llama_out, fmt):
    result = audit_export(llama_out / fmt)
    assert result.ok, result.problems
    # The compressed-tensors formats carry the KV-cache scales of both layers (k and v), mapped onto attn.
    assert result.tensors_checked > 20 and result.scales_checked > 0
    assert result.kv_scales_found == (4 if fmt in (STATIC, DYNAMIC) else 0)


@pytest.mark.parametrize("fmt", NOT_AUDITED)
def test_exports_without_rules_are_reported_not_audited(llama_out, fmt):
    result = audit_export(llama_out / fmt)
    assert not result.audited and not result.ok and result.notes[0].startswith("not audited")


@pytest.mark.parametrize("fmt", [STATIC, DYNAMIC])
@pytest.mark.parametrize("name", list(MOE_CONFIGS))
def test_moe_exports_pass(moe_out, name, fmt):
    result = audit_export(moe_out[name] / fmt)
    assert result.ok, result.problems
    # Every expert matrix of both layers carries its scale(s): 2 layers x 8 experts x 3 matrices.
    assert result.scales_checked >= 48 * (2 if fmt == STATIC else 1)


def test_compressed_tensors_own_matching_agrees_with_the_fp8_weights(llama_out):
    """compressed-tensors' own target/ignore matching picks exactly the Linears the export stores in FP8."""
    from compressed_tensors.utils import match_named_modules
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    directory = llama_out / STATIC
    config = AutoConfig.from_pretrained(directory)
    quant = config.quantization_config if isinstance(config.quantization_config, dict) \
        else config.quantization_config.to_dict()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    targets = quant["config_groups"]["group_0"]["targets"]
    matched = {name for name, _ in match_named_modules(model, targets, quant["ignore"])}
    with safe_open(directory / "model.safetensors", "pt") as handle:
        fp8 = {key.removesuffix(".weight") for key in handle.keys()
               if key.endswith(".weight") and handle.get_slice(key).get_dtype() == "F8_E4M3"}
    assert matched == fp8 and audit_export(directory).ok


def test_renamed_scale_is_dropped_and_its_slot_missing(llama_out, tmp_path):
    directory = copy(llama_out / STATIC, tmp_path)
    prefix = "model.layers.1.mlp.down_proj"
    rewrite_tensors(directory, lambda t: t.__setitem__(f"{prefix}.activation_scale", t.pop(f"{prefix}.input_scale")))
    result = audit_export(directory)
    assert fired(result) == {(Rule.SCALE_DROPPED, f"{prefix}.activation_scale"),
                             (Rule.MISSING_SCALE, f"{prefix}.input_scale")}


def test_input_scale_in_a_dynamic_moe_export_maps_to_no_expert_parameter(moe_out, tmp_path):
    directory = copy(moe_out["mixtral"] / DYNAMIC, tmp_path)
    key = "model.layers.1.block_sparse_moe.experts.3.w1.input_scale"
    rewrite_tensors(directory, lambda t: t.__setitem__(key, torch.ones(1)))
    result = audit_export(directory)
    assert fired(result) == {(Rule.SCALE_DROPPED, key)}
    assert "experts.w13_input_scale" in result.problems[0].message


def test_kv_scale_outside_attention_is_dropped(llama_out, tmp_path):
    directory = copy(llama_out / STATIC, tmp_path)
    rewrite_tensors(directory, lambda t: t.__setitem__("model.layers.1.mlp.k_scale", t.pop(
        "model.layers.1.self_attn.k_scale")))
    result = audit_export(directory)
    assert fired(result) == {(Rule.SCALE_DROPPED, "model.layers.1.mlp.k_scale")}
    assert "model.layers.1.mlp.attn.k_scale" in result.problems[0].message


def test_kv_scales_without_a_kv_cache_scheme_get_a_note(llama_out, tmp_path):
    directory = copy(llama_out / BLOCK, tmp_path)
    rewrite_tensors(directory, lambda t: t.update({f"model.layers.{i}.self_attn.{kv}_scale": torch.ones(1)
                                                   for i in range(2) for kv in "kv"}))
    result = audit_export(directory)
    assert result.ok and result.kv_scales_found == 4 and "--kv-cache-dtype fp8" in result.notes[0]


@pytest.mark.parametrize("fmt, scale", [(STATIC, "weight_scale"), (STATIC, "input_scale"),
                                        (DYNAMIC, "weight_scale"), (BLOCK, "weight_scale_inv")])
def test_dropped_scale_is_missing(llama_out, tmp_path, fmt, scale):
    directory = copy(llama_out / fmt, tmp_path)
    key = f"model.layers.1.self_attn.o_proj.{scale}"
    rewrite_tensors(directory, lambda t: t.pop(key))
    assert fired(audit_export(directory)) == {(Rule.MISSING_SCALE, key)}


@pytest.mark.parametrize("fmt, key, shape", [(DYNAMIC, "model.layers.1.mlp.up_proj.weight_scale", (1,)),
                                             (STATIC, "model.layers.1.mlp.up_proj.weight_scale", (256, 1)),
                                             (BLOCK, "model.layers.1.mlp.up_proj.weight_scale_inv", (1, 2))])
def test_scale_of_another_scheme_has_the_wrong_shape(llama_out, tmp_path, fmt, key, shape):
    directory = copy(llama_out / fmt, tmp_path)
    rewrite_tensors(directory, lambda t: t.__setitem__(key, torch.ones(shape, dtype=t[key].dtype)))
    assert fired(audit_export(directory)) == {(Rule.WRONG_SCALE_SHAPE, key)}


def test_integer_scale_has_the_wrong_dtype(llama_out, tmp_path):
    directory = copy(llama_out / STATIC, tmp_path)
    key = "model.layers.1.mlp.up_proj.weight_scale"
    rewrite_tensors(directory, lambda t: t.__setitem__(key, torch.ones(1, dtype=torch.int32)))
    assert fired(audit_export(directory)) == {(Rule.WRONG_SCALE_DTYPE, key)}


def test_only_q_proj_quantized_is_a_partly_quantized_fused_group(llama_out, tmp_path):
    directory = copy(llama_out / STATIC, tmp_path)
    q = LAYER0_QKV[0]

    def quantize_q(tensors):
        weight = tensors[f"{q}.weight"]
        scale = (weight.abs().max() / 448).reshape(1)
        tensors[f"{q}.weight"] = (weight / scale).to(torch.float8_e4m3fn)
        tensors[f"{q}.weight_scale"] = scale
        tensors[f"{q}.input_scale"] = torch.ones(1, dtype=weight.dtype)

    rewrite_tensors(directory, quantize_q)
    result = audit_export(directory)
    assert (Rule.PARTLY_QUANTIZED_FUSED_GROUP, "model.layers.0.self_attn.qkv_proj") in fired(result)
    # The ignore list still names q_proj, so vLLM would also build it in high precision and reject its scales.
    assert (Rule.QUANTIZED_BUT_IGNORED, q) in fired(result)


def test_one_dequantized_expert_matrix_is_a_partly_quantized_fused_group(moe_out, tmp_path):
    directory = copy(moe_out["qwen2_moe"] / DYNAMIC, tmp_path)
    prefix = "model.layers.0.mlp.experts.5.down_proj"

    def dequantize(tensors):
        tensors[f"{prefix}.weight"] = tensors[f"{prefix}.weight"].float() * tensors.pop(f"{prefix}.weight_scale")

    rewrite_tensors(directory, dequantize)
    result = audit_export(directory)
    assert fired(result) == {(Rule.PARTLY_QUANTIZED_FUSED_GROUP, "model.layers.0.mlp.experts"),
                             (Rule.UNQUANTIZED_NOT_IGNORED, prefix)}


@pytest.mark.parametrize("fmt, field", [(STATIC, "ignore"), (BLOCK, "modules_to_not_convert")])
def test_bogus_ignore_entries_match_no_module(llama_out, tmp_path, fmt, field):
    directory = copy(llama_out / fmt, tmp_path)
    bogus = ["model.layers.0.self_attn.qkv_prj", "model.layers.7.mlp.down_proj"]
    if fmt == STATIC:
        bogus.append("re:.*\\.cross_attn\\..*")
    rewrite_config(directory, lambda q: q[field].extend(bogus))
    assert fired(audit_export(directory)) == {(Rule.IGNORED_MODULE_MISSING, entry) for entry in bogus}


def test_fused_and_regex_ignore_entries_count_as_present(llama_out, tmp_path):
    directory = copy(llama_out / STATIC, tmp_path)
    rewrite_config(directory, lambda q: q.__setitem__("ignore", ["model.layers.0.self_attn.qkv_proj",
                                                                  "re:.*\\.layers\\.0\\.self_attn\\.[qkv]_proj$",
                                                                  "lm_head"]))
    assert audit_export(directory).ok


@pytest.mark.parametrize("fmt, field", [(STATIC, "ignore"), (BLOCK, "modules_to_not_convert")])
def test_removed_ignore_entries_leave_high_precision_weights_unignored(llama_out, tmp_path, fmt, field):
    directory = copy(llama_out / fmt, tmp_path)
    rewrite_config(directory, lambda q: q.__setitem__(field, [e for e in q[field] if e not in LAYER0_QKV]))
    assert fired(audit_export(directory)) == {(Rule.UNQUANTIZED_NOT_IGNORED, name) for name in LAYER0_QKV}


def test_lm_head_and_routers_need_no_ignore_entry(moe_out, tmp_path):
    """vLLM builds lm_head as ParallelLMHead and routers without a quant config: never FP8."""
    directory = copy(moe_out["mixtral"] / STATIC, tmp_path)
    rewrite_config(directory, lambda q: q.__setitem__("ignore", LAYER0_QKV))
    assert audit_export(directory).ok


def test_one_shard_left_out_of_the_ignore_list_is_partly_ignored(llama_out, tmp_path):
    directory = copy(llama_out / STATIC, tmp_path)
    rewrite_config(directory, lambda q: q["ignore"].remove("model.layers.0.self_attn.k_proj"))
    assert fired(audit_export(directory)) == {(Rule.PARTLY_IGNORED_FUSED_GROUP, "model.layers.0.self_attn.qkv_proj")}


def test_quantized_layer_in_the_ignore_list(llama_out, tmp_path):
    directory = copy(llama_out / DYNAMIC, tmp_path)
    layer = "model.layers.1.mlp.down_proj"
    rewrite_config(directory, lambda q: q["ignore"].append(layer))
    assert fired(audit_export(directory)) == {(Rule.QUANTIZED_BUT_IGNORED, layer),
                                              (Rule.SCALE_DROPPED, f"{layer}.weight_scale")}


@pytest.mark.parametrize("edit", [
    lambda q: q["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"),
    lambda q: q.update(quant_method="modelopt"),
    lambda q: q.update(quant_method="mxfp8"),
])
def test_formats_without_rules_are_reported_not_audited(llama_out, tmp_path, edit):
    directory = copy(llama_out / STATIC, tmp_path)
    rewrite_config(directory, edit)
    result = audit_export(directory)
    assert not result.audited and not result.ok and result.notes[0].startswith("not audited")
