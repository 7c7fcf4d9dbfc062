"""The load audit: real serving exports pass it, and each deliberately broken export trips exactly its rule.

Exports come from run_conversion (the tiny Llama, and the tiny Mixtral and Qwen2-MoE of tests/models.py), in
every serving format; each breaking test copies one into tmp_path and rewrites its safetensors file or config.json
(or ModelOpt's hf_quant_config.json).
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
NVFP4, NVFP4_A16, MXFP8, MO_FP8, MO_NVFP4 = "nvfp4", "nvfp4-a16", "mxfp8", "modelopt-fp8", "modelopt-nvfp4"
AUDITED = SERVING_FORMAT_NAMES
LOW_PRECISION = (MXFP8, NVFP4, NVFP4_A16, MO_FP8, MO_NVFP4)
CALIBRATION = CalibrationSettings(steps=2, seq_len=16)
HF_QUANT = "hf_quant_config.json"
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
        formats = (STATIC, DYNAMIC, *(LOW_PRECISION if name == "mixtral" else ()))
        request = ConversionRequest(model=str(moe_root / name), recipe={"backend": "te"}, calibration=CALIBRATION,
                                    serving_formats=formats)
        run_conversion(request, moe_root / f"{name}-audit", ModelSourceOptions(allowed_roots=(moe_root,)))
    return {name: moe_root / f"{name}-audit" / "serving" for name in MOE_CONFIGS}


def copy(export, tmp_path):
    return shutil.copytree(export, tmp_path / export.name)


def rewrite_tensors(directory, edit):
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def rewrite_config(directory, edit, file="config.json", key="quantization_config"):
    config = json.loads((directory / file).read_text())
    edit(config[key])
    (directory / file).write_text(json.dumps(config))


def fired(result):
    return {(problem.rule, problem.name) for problem in result.problems}


@pytest.mark.parametrize("fmt", AUDITED)
def test_llama_exports_pass(llama_out, fmt):
    result = audit_export(llama_out / fmt)
    assert result.ok, result.problems
    # The compressed-tensors FP8 formats (and the ModelOpt ones, once they write them) carry the KV-cache scales of
    # both layers (k and v), mapped onto attn.
    assert result.tensors_checked > 20 and result.scales_checked > 0
    assert result.kv_scales_found == 4 if fmt in (STATIC, DYNAMIC) else result.kv_scales_found in (0, 4)
    assert result.format.startswith("modelopt/" if fmt.startswith("modelopt") else ("fp8" if "block" in fmt
                                                                                     else "compressed-tensors"))


@pytest.mark.parametrize("fmt", LOW_PRECISION)
def test_mixtral_low_precision_exports_pass(moe_out, fmt):
    result = audit_export(moe_out["mixtral"] / fmt)
    assert result.ok, result.problems
    # 2 layers x 8 experts x 3 matrices, each with at least its block scale
    assert result.scales_checked >= 48


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
    # and the attention layer it was taken from is left with its v_scale alone
    assert fired(result) == {(Rule.SCALE_DROPPED, "model.layers.1.mlp.k_scale"),
                             (Rule.MISSING_SCALE, "model.layers.1.self_attn")}
    assert any("model.layers.1.mlp.attn.k_scale" in p.message for p in result.problems)


@pytest.mark.parametrize("scale, kept", [("v_scale", "k_scale"), ("k_scale", "v_scale")])
def test_an_attention_layer_with_one_of_its_two_kv_scales_is_missing_the_other(llama_out, tmp_path, scale, kept):
    """vLLM loads such a layer and runs keys and values on the one scale it has (tests/engines shows it)."""
    directory = copy(llama_out / STATIC, tmp_path)
    rewrite_tensors(directory, lambda t: t.pop(f"model.layers.0.self_attn.{scale}"))
    result = audit_export(directory)
    assert fired(result) == {(Rule.MISSING_SCALE, "model.layers.0.self_attn")}
    assert f"no {scale}" in result.problems[0].message and f"on {kept}" in result.problems[0].message


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


# NVFP4, MXFP8 and ModelOpt: one broken export per rule.
DOWN1 = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize("fmt, scale", [(NVFP4, "weight_global_scale"), (NVFP4, "input_global_scale"),
                                        (NVFP4_A16, "weight_scale"), (MXFP8, "weight_scale"),
                                        (MO_FP8, "input_scale"), (MO_NVFP4, "weight_scale_2")])
def test_dropped_low_precision_scale_is_missing(llama_out, tmp_path, fmt, scale):
    directory = copy(llama_out / fmt, tmp_path)
    rewrite_tensors(directory, lambda t: t.pop(f"{DOWN1}.{scale}"))
    assert fired(audit_export(directory)) == {(Rule.MISSING_SCALE, f"{DOWN1}.{scale}")}


def test_input_global_scale_in_a_weight_only_nvfp4_export_maps_to_no_parameter(llama_out, tmp_path):
    directory = copy(llama_out / NVFP4_A16, tmp_path)
    rewrite_tensors(directory, lambda t: t.__setitem__(f"{DOWN1}.input_global_scale", torch.ones(1)))
    assert fired(audit_export(directory)) == {(Rule.SCALE_DROPPED, f"{DOWN1}.input_global_scale")}


@pytest.mark.parametrize("fmt, scale, dtype", [(NVFP4, "weight_scale", torch.bfloat16),
                                               (NVFP4, "weight_scale", torch.uint8),
                                               (MO_NVFP4, "weight_scale", torch.float32),
                                               (MXFP8, "weight_scale", torch.float32),
                                               (MO_NVFP4, "weight_scale_2", torch.int32)])
def test_low_precision_scale_of_the_wrong_dtype(llama_out, tmp_path, fmt, scale, dtype):
    directory = copy(llama_out / fmt, tmp_path)
    key = f"{DOWN1}.{scale}"
    rewrite_tensors(directory, lambda t: t.__setitem__(key, t[key].float().to(dtype)))
    assert fired(audit_export(directory)) == {(Rule.WRONG_SCALE_DTYPE, key)}


@pytest.mark.parametrize("fmt, columns", [(NVFP4, 4), (MXFP8, 8), (MO_NVFP4, 16)])
def test_block_scale_of_another_group_size_has_the_wrong_shape(llama_out, tmp_path, fmt, columns):
    """down_proj is [128, 256]: 16 scales a row for NVFP4, 8 for MXFP8; these are other group sizes."""
    directory = copy(llama_out / fmt, tmp_path)
    key = f"{DOWN1}.weight_scale"
    rewrite_tensors(directory, lambda t: t.__setitem__(key, t[key][:, :columns // 2].repeat(1, 2)[:, :columns]
                                                       if columns < t[key].shape[1] else t[key].repeat(1, 2)))
    assert fired(audit_export(directory)) == {(Rule.WRONG_SCALE_SHAPE, key)}


@pytest.mark.parametrize("fmt, scale", [(NVFP4, "weight_global_scale"), (NVFP4, "input_global_scale"),
                                        (NVFP4_A16, "weight_global_scale"), (MO_NVFP4, "weight_scale_2"),
                                        (MO_NVFP4, "input_scale")])
def test_fused_shards_with_different_global_scales(llama_out, tmp_path, fmt, scale):
    directory = copy(llama_out / fmt, tmp_path)
    key = f"model.layers.1.mlp.up_proj.{scale}"
    rewrite_tensors(directory, lambda t: t.__setitem__(key, t[key] * 2))
    result = audit_export(directory)
    assert fired(result) == {(Rule.FUSED_GLOBAL_SCALE_DIFFERS, f"model.layers.1.mlp.gate_up_proj.{scale}")}
    assert "gate_proj=" in result.problems[0].message and "up_proj=" in result.problems[0].message


def test_modelopt_fp8_shards_may_differ_in_weight_scale(llama_out, tmp_path):
    """ModelOptFp8LinearMethod requantizes a fused layer to its largest weight scale: nothing is lost."""
    directory = copy(llama_out / MO_FP8, tmp_path)
    key = "model.layers.1.mlp.up_proj.weight_scale"
    rewrite_tensors(directory, lambda t: t.__setitem__(key, t[key] * 2))
    assert audit_export(directory).ok


@pytest.mark.parametrize("fmt, scale", [(NVFP4, "weight_global_scale"), (MO_NVFP4, "weight_scale_2")])
def test_expert_w1_and_w3_with_different_global_scales(moe_out, tmp_path, fmt, scale):
    directory = copy(moe_out["mixtral"] / fmt, tmp_path)
    key = f"model.layers.0.block_sparse_moe.experts.2.w3.{scale}"
    rewrite_tensors(directory, lambda t: t.__setitem__(key, t[key] * 2))
    assert fired(audit_export(directory)) == {
        (Rule.FUSED_GLOBAL_SCALE_DIFFERS, f"model.layers.0.block_sparse_moe.experts.w13[2].{scale}")}


@pytest.mark.parametrize("fmt", [NVFP4, MXFP8])
def test_low_precision_expert_scale_dropped(moe_out, tmp_path, fmt):
    directory = copy(moe_out["mixtral"] / fmt, tmp_path)
    key = "model.layers.1.block_sparse_moe.experts.5.w2.weight_scale"
    rewrite_tensors(directory, lambda t: t.pop(key))
    assert fired(audit_export(directory)) == {(Rule.MISSING_SCALE, key)}


@pytest.mark.parametrize("fmt", [MO_FP8, MO_NVFP4])
def test_bogus_modelopt_exclude_entries_match_no_module(llama_out, tmp_path, fmt):
    directory = copy(llama_out / fmt, tmp_path)
    bogus = ["model.layers.0.self_attn.qkv_prj", "model.layers.*.cross_attn*", "vision_tower"]
    rewrite_config(directory, lambda q: q["ignore"].extend(bogus))
    assert fired(audit_export(directory)) == {(Rule.IGNORED_MODULE_MISSING, entry) for entry in bogus}


def test_modelopt_wildcard_and_substring_excludes_cover_modules(llama_out, tmp_path):
    """is_layer_excluded: an entry that is a substring of the layer's name, or an fnmatch wildcard over it."""
    directory = copy(llama_out / MO_NVFP4, tmp_path)
    rewrite_config(directory, lambda q: q.__setitem__("ignore", ["lm_head", "model.layers.0.self_attn"]))
    assert fired(audit_export(directory)) == {(Rule.QUANTIZED_BUT_IGNORED, "model.layers.0.self_attn.o_proj")} | {
        (Rule.SCALE_DROPPED, f"model.layers.0.self_attn.o_proj.{s}")
        for s in ("weight_scale", "weight_scale_2", "input_scale")}
    rewrite_config(directory, lambda q: q.__setitem__("ignore", ["model.layers.0.self_attn.qkv*"]))
    assert audit_export(directory).ok
    # vLLM asks about the fused layer (qkv_proj) by name: a wildcard over its shards' names excludes nothing.
    rewrite_config(directory, lambda q: q.__setitem__("ignore", ["model.layers.0.self_attn.[qkv]_proj"]))
    assert fired(audit_export(directory)) == {(Rule.UNQUANTIZED_NOT_IGNORED, name) for name in LAYER0_QKV}


def test_modelopt_exclude_list_without_attention_shards(llama_out, tmp_path):
    directory = copy(llama_out / MO_FP8, tmp_path)
    rewrite_config(directory, lambda q: q.__setitem__("ignore", [e for e in q["ignore"] if e not in LAYER0_QKV]))
    assert fired(audit_export(directory)) == {(Rule.UNQUANTIZED_NOT_IGNORED, name) for name in LAYER0_QKV}


def test_modelopt_exclude_naming_one_shard_is_partly_ignored(llama_out, tmp_path):
    directory = copy(llama_out / MO_NVFP4, tmp_path)
    rewrite_config(directory, lambda q: q["ignore"].remove("model.layers.0.self_attn.v_proj"))
    assert fired(audit_export(directory)) == {(Rule.PARTLY_IGNORED_FUSED_GROUP, "model.layers.0.self_attn.qkv_proj")}


def test_modelopt_experts_excluded_by_wildcard(moe_out, tmp_path):
    directory = copy(moe_out["mixtral"] / MO_FP8, tmp_path)
    rewrite_config(directory, lambda q: q["ignore"].append("model.layers.1.block_sparse_moe.experts*"))
    experts = {name for rule, name in fired(audit_export(directory)) if rule == Rule.QUANTIZED_BUT_IGNORED}
    assert len(experts) == 24 and all(".layers.1.block_sparse_moe.experts." in name for name in experts)


def test_modelopt_hf_quant_config_alone_is_audited(llama_out, tmp_path):
    """Without config.json's quantization_config vLLM reads hf_quant_config.json (with --quantization)."""
    directory = copy(llama_out / MO_NVFP4, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    (directory / "config.json").write_text(json.dumps(config))
    result = audit_export(directory)
    assert result.ok and result.format == "modelopt/NVFP4" and "--quantization modelopt" in result.notes[0]
    rewrite_config(directory, lambda q: q["exclude_modules"].append("model.layers.9.mlp"), HF_QUANT, "quantization")
    assert fired(audit_export(directory)) == {(Rule.IGNORED_MODULE_MISSING, "model.layers.9.mlp")}
    rewrite_config(directory, lambda q: q.pop("kv_cache_quant_algo"), HF_QUANT, "quantization")
    assert (Rule.CONFIG_REJECTED, HF_QUANT) in fired(audit_export(directory))


def test_modelopt_algorithms_without_rules_are_not_audited(llama_out, tmp_path):
    directory = copy(llama_out / MO_FP8, tmp_path)
    rewrite_config(directory, lambda q: q.update(quant_algo="FP8_PB_WO"))
    result = audit_export(directory)
    assert not result.audited and "FP8_PB_WO" in result.notes[0]
