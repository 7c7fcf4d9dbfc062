"""``sync_serving`` end to end: real training artifacts (TE and torchao recipes) of a tiny bf16 Llama, their serving
exports compared bit for bit with the training libraries' own casts, loaded by transformers, and audited."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from converters.errors import ArtifactError, ConversionError, ModelConfigError, RequestError
from converters.model.demo import build_tiny_llama
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.serving.audit import audit_export
from converters.sync import SYNC_REPORT_NAME, sync_serving

pytest.importorskip("torchao")

from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402

from tests.converters.serving.test_training_twin_te import (  # noqa: E402
    _te_quantize_square_block_tiling,
    _te_ref_per_tensor_cs_cast,
)
from tests.converters.serving.test_training_twin_torchao import _torchao_weight_cast  # noqa: E402

RECIPES = {
    "te_block_pow2": {"backend": "te", "scaling": "float8_block"},
    "te_block_fp32": {"backend": "te", "scaling": "float8_block", "use_f32_scales": True},
    "te_mxfp8": {"backend": "te", "scaling": "mxfp8_block"},
    "te_delayed": {"backend": "te"},
    "te_current": {"backend": "te", "scaling": "current"},
    "ao_rowwise": {"backend": "ao", "recipe_name": "rowwise", "emulate": True},
    "ao_tensorwise": {"backend": "ao", "recipe_name": "tensorwise", "emulate": True},
    "ao_mxfp8_floor": {"backend": "ao", "scaling": "mxfp8_training_op", "kernel_preference": "emulated",
                       "scale_calculation_mode": "floor"},
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("sync")
    build_tiny_llama(base / "llama", hidden_size=256)
    return base


def artifact(workspace: Path, name: str) -> Path:
    """The training artifact of the tiny Llama under ``RECIPES[name]`` (built once per module)."""
    out = workspace / f"artifact-{name}"
    if not out.is_dir():
        request = ConversionRequest(model=str(workspace / "llama"), recipe=RECIPES[name], measure=False,
                                    calibration=CalibrationSettings(steps=1, seq_len=16))
        run_conversion(request, out, ModelSourceOptions(allowed_roots=(workspace,)))
    return out


def _source_weights(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def _export(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(directory / "model.safetensors", "pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _check_common(artifact_dir: Path, out: Path, report: dict) -> dict[str, torch.Tensor]:
    """Pass-through tensors are the source's bytes; config has the format's block and no fp8 block; audit clean."""
    source, exported = _source_weights(artifact_dir), _export(out)
    cast = set(report["quantized"])
    for name, tensor in source.items():
        if name not in cast:
            assert torch.equal(_bytes(exported[name]), _bytes(tensor)), name
    config = json.loads((out / "config.json").read_text())
    assert "fp8" not in config and "quantization_config" in config
    assert json.loads((out / SYNC_REPORT_NAME).read_text())["format"] == report["format"]
    audit = audit_export(out)
    assert audit.audited and not audit.problems, audit.to_dict()
    return exported


@pytest.mark.parametrize(("name", "pow2"), [("te_block_pow2", True), ("te_block_fp32", False)])
def test_te_float8_block_artifact_syncs_to_tes_block_cast(workspace, name, pow2):
    art = artifact(workspace, name)
    out = workspace / f"serving-{name}"
    report = sync_serving(art, out)
    assert report["format"] == ("fp8-block-ue8m0-te" if pow2 else "fp8-block-te")
    assert report["serving"][report["format"]]["training_twin"]["identical"] is True
    exported = _check_common(art, out, report)
    source = _source_weights(art)
    assert "model.layers.1.mlp.down_proj.weight" in report["quantized"]
    for key in report["quantized"]:
        data, scale_inv = _te_quantize_square_block_tiling(source[key], torch.float8_e4m3fn, 128, pow_2_scales=pow2,
                                                           eps=0.0)
        assert torch.equal(_bytes(exported[key]), _bytes(data)), key
        assert torch.equal(exported[f"{key}_scale_inv"], scale_inv), key


def test_partly_converted_fused_groups_stay_in_high_precision_and_are_named(workspace):
    """The training skipped the first Linear (q_proj of layer 0): its k/v ran in FP8, but an engine needs q/k/v
    of one scheme, so they stay in high precision and the report says that their numbers differ from training's."""
    art = artifact(workspace, "te_block_pow2")
    report = sync_serving(art, workspace / "serving-fused")
    assert report["kept"]["model.layers.0.self_attn.q_proj"] == "not_converted_in_training"
    assert report["kept"]["model.layers.0.self_attn.k_proj"].startswith("fused_group_not_fully_converted")
    assert report["differs_from_training"] == ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    ignored = json.loads((workspace / "serving-fused" / "config.json").read_text())["quantization_config"]
    assert "model.layers.0.self_attn.k_proj" in ignored["modules_to_not_convert"]


def test_te_current_scaling_artifact_syncs_to_tes_per_tensor_cast(workspace):
    art = artifact(workspace, "te_current")
    out = workspace / "serving-te-current"
    report = sync_serving(art, out)
    assert report["format"] == "compressed-tensors-fp8-te-tensorwise"
    exported = _check_common(art, out, report)
    source = _source_weights(art)
    for key in report["quantized"]:
        data, scale_inv = _te_ref_per_tensor_cs_cast(source[key], torch.float8_e4m3fn)
        assert torch.equal(_bytes(exported[key]), _bytes(data)), key
        assert torch.equal(exported[key.removesuffix("weight") + "weight_scale"], scale_inv), key


@pytest.mark.parametrize(("name", "recipe"), [("ao_rowwise", "rowwise"), ("ao_tensorwise", "tensorwise")])
def test_torchao_float8_artifact_syncs_to_float8_linears_cast(workspace, name, recipe):
    art = artifact(workspace, name)
    out = workspace / f"serving-{name}"
    report = sync_serving(art, out)
    assert report["format"] == f"compressed-tensors-fp8-torchao-{recipe}"
    exported = _check_common(art, out, report)
    source = _source_weights(art)
    for key in report["quantized"]:
        reference = _torchao_weight_cast(source[key], recipe)
        assert torch.equal(_bytes(exported[key]), _bytes(reference._data.t())), key
        scale = exported[key.removesuffix("weight") + "weight_scale"]
        assert torch.equal(scale, reference._scale.reciprocal().t().reshape(scale.shape)), key


@pytest.mark.parametrize(("name", "mode"), [("te_mxfp8", ScaleCalculationMode.RCEIL),
                                            ("ao_mxfp8_floor", ScaleCalculationMode.FLOOR)])
def test_mxfp8_artifacts_sync_to_the_mx_cast(workspace, name, mode):
    """TE MXFP8 (bf16 weights: equal to torchao's RCEIL, see the twin tests) and torchao's MXFP8 training config."""
    art = artifact(workspace, name)
    out = workspace / f"serving-{name}"
    report = sync_serving(art, out)
    assert report["format"] == ("mxfp8-te" if name == "te_mxfp8" else "mxfp8-floor")
    exported = _check_common(art, out, report)
    source = _source_weights(art)
    for key in report["quantized"]:
        scale, data = to_mx(source[key], torch.float8_e4m3fn, 32, mode)
        assert torch.equal(_bytes(exported[key]), _bytes(data)), key
        assert torch.equal(exported[key.removesuffix("weight") + "weight_scale"], scale.view(torch.uint8)), key


def test_synced_exports_load_in_transformers_and_match_the_bf16_model(workspace):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(workspace / "llama", dtype=torch.bfloat16)
    tokens = torch.arange(1, 33).reshape(1, 32)
    expected = reference(tokens).logits.float()
    for name in ("te_block_pow2", "ao_rowwise", "ao_tensorwise"):
        out = workspace / f"serving-load-{name}"
        sync_serving(artifact(workspace, name), out)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
        logits = model(tokens).logits.float()
        cosine = torch.nn.functional.cosine_similarity(logits.flatten(), expected.flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))


def test_a_checkpoint_written_by_training_is_synced_from_its_own_weights(workspace):
    """torchao training on the loaded artifact (Float8Linear, emulated on the CPU), one step, save_pretrained; TE's
    ``._extra_state`` entries (as te.Linear's state dict names them) are left out of the export."""
    from converters.backends.loaders import load_torchao

    art = artifact(workspace, "ao_rowwise")
    model = load_torchao(art)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    tokens = torch.arange(1, 33).reshape(1, 32)
    model(tokens, labels=tokens).loss.backward()
    optimizer.step()
    trained = workspace / "trained"
    model.save_pretrained(trained)
    weights = load_file(trained / "model.safetensors")
    weights["model.layers.1.mlp.down_proj._extra_state"] = torch.zeros(16, dtype=torch.uint8)
    save_file(weights, trained / "model.safetensors", metadata={"format": "pt"})
    report = sync_serving(art, workspace / "serving-trained", weights=trained)
    assert report["dropped"] == ["model.layers.1.mlp.down_proj._extra_state"]
    exported = _export(workspace / "serving-trained")
    key = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(weights[key], _source_weights(art)[key])  # the step moved it
    reference = _torchao_weight_cast(weights[key], "rowwise")
    assert torch.equal(_bytes(exported[key]), _bytes(reference._data.t()))
    assert "model.layers.1.mlp.down_proj._extra_state" not in exported


def test_bad_inputs_are_refused_and_leave_nothing_behind(workspace):
    art = artifact(workspace, "ao_rowwise")
    with pytest.raises(ArtifactError, match="no fp8 block"):
        sync_serving(workspace / "llama", workspace / "x1")
    with pytest.raises(RequestError, match="has no serving twin") as raised:
        sync_serving(artifact(workspace, "te_delayed"), workspace / "x2")
    assert raised.value.field == "format"
    with pytest.raises(RequestError, match="static input scales"):
        sync_serving(art, workspace / "x3", format_name="compressed-tensors-fp8")
    with pytest.raises(RequestError, match="already exists"):
        sync_serving(art, workspace / "llama")
    partial = workspace / "partial"
    partial.mkdir()
    (partial / "config.json").write_text((workspace / "llama" / "config.json").read_text())
    weights = _source_weights(art)
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, partial / "model.safetensors")
    with pytest.raises(ConversionError, match="holds no weight for 1 Linear"):
        sync_serving(art, workspace / "x4", weights=partial)
    assert not any((workspace / name).exists() for name in ("x1", "x2", "x3", "x4", ".x4.partial"))


def test_a_recipe_without_twin_syncs_to_a_chosen_format_and_says_it_is_not_identical(workspace):
    report = sync_serving(artifact(workspace, "te_delayed"), workspace / "serving-delayed", format_name="fp8-block")
    assert report["serving"]["fp8-block"]["training_twin"] == {
        "recipe": report["serving"]["fp8-block"]["training_twin"]["recipe"], "identical": False, "twin": None}


def test_a_calibrated_job_writes_the_same_twin_bytes_as_sync(workspace):
    """The twins are serving formats like the others: ``convert --serving`` writes them (audited by the job), and
    the weights both quantize hold the same bytes."""
    twins = ("fp8-block-ue8m0-te", "mxfp8-te", "compressed-tensors-fp8-torchao-rowwise")
    out = workspace / "artifact-with-serving"
    request = ConversionRequest(model=str(workspace / "llama"), recipe=RECIPES["te_block_pow2"], measure=False,
                                calibration=CalibrationSettings(steps=1, seq_len=16), serving_formats=twins)
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(workspace,)))
    for name in twins:
        report = sync_serving(out, workspace / f"synced-{name}", format_name=name)
        from_job, from_sync = _export(out / "serving" / name), _export(workspace / f"synced-{name}")
        common = [key for key in report["quantized"] if from_job[key].dtype == torch.float8_e4m3fn]
        assert len(common) >= 8, name
        for key in common:
            assert torch.equal(_bytes(from_job[key]), _bytes(from_sync[key])), (name, key)


def test_a_weight_holding_nan_is_refused_as_the_serving_export_refuses_it_and_leaves_nothing(workspace):
    """sync converts each weight as the serving export does, finiteness check included: a training checkpoint with a
    damaged weight is named, not written as NaN codes."""
    art = artifact(workspace, "ao_rowwise")
    damaged = workspace / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text((workspace / "llama" / "config.json").read_text())
    weights = _source_weights(art)
    key = "model.layers.1.mlp.down_proj.weight"
    weights[key] = weights[key].clone()
    weights[key][0, 0] = float("nan")
    save_file(weights, damaged / "model.safetensors")
    with pytest.raises(ModelConfigError, match=f"{key} holds NaN") as caught:
        sync_serving(art, workspace / "x-nan", weights=damaged)
    assert caught.value.field == "model"
    assert not any((workspace / name).exists() for name in ("x-nan", ".x-nan.partial"))
