"""A job whose recipe asks ``nvfp4_weight_rounding: gptq`` writes NVFP4 exports whose codes calibration rounded by
GPTQ under the writer's own scales (the recipe's block-scale method, one global scale per fused group), the same
weights in ``nvfp4`` and ``nvfp4-a16``; the bytes are the same when the export is written as shard tasks; the
report says what was rounded and what it cost; the rounded-weights directory never reaches the artifact; a job that
cannot round by GPTQ is refused naming the field."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from converters.calibration.gptq_rounding import ROUNDED_DIR
from converters.errors import ConversionError, RequestError
from converters.model.demo import build_tiny_llama
from converters.model.sources import ModelSourceOptions, confinement_for
from converters.pipeline.driver import run_conversion, run_stages
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.pipeline.serving_export import (
    finish_serving_export,
    run_serving_write,
    serving_shard_tasks,
    write_serving_exports,
)
from converters.pipeline.state import NullSink, Run, Stage
from converters.serving.nvfp4 import quantize_nvfp4
from tests.converters.serving.exports import CALIBRATION, export, tiny_llama

W4A4, A16, FP8, MODELOPT = "nvfp4", "nvfp4-a16", "compressed-tensors-fp8", "modelopt-nvfp4"
RECIPE = {"backend": "ao", "nvfp4_weight_scales": "four_over_six", "nvfp4_weight_rounding": "gptq"}
GROUPS = ([f"model.layers.1.self_attn.{name}_proj" for name in "qkv"], ["model.layers.1.mlp.down_proj"])


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    model_dir = tiny_llama(tmp_path_factory, "nvfp4-gptq")
    return model_dir, export(model_dir, (W4A4, A16, FP8, MODELOPT), recipe=RECIPE)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}


def _group_amax(source: dict[str, torch.Tensor], group: list[str]) -> float:
    """The fused group's largest |w|: the writers' shared weight amax."""
    return max(float(source[f"{path}.weight"].float().abs().max()) for path in group)


def test_the_exports_hold_gptq_codes_under_the_recipes_scales(job):
    model_dir, out = job
    source = _tensors(model_dir / "model.safetensors")
    served, weight_only = (_tensors(out / "serving" / name / "model.safetensors") for name in (W4A4, A16))
    for group in GROUPS:
        amax = _group_amax(source, group)
        for path in group:
            nearest, scale, scale_global = quantize_nvfp4(source[f"{path}.weight"], amax, scale_search="four_over_six")
            assert torch.equal(served[f"{path}.weight_scale"].view(torch.uint8), scale.view(torch.uint8))
            assert torch.equal(served[f"{path}.weight_global_scale"], scale_global)  # the group's, shared
            assert not torch.equal(served[f"{path}.weight_packed"], nearest)  # other codes under the same scales
            for name in ("weight_packed", "weight_scale", "weight_global_scale"):
                assert torch.equal(weight_only[f"{path}.{name}"].view(torch.uint8),
                                   served[f"{path}.{name}"].view(torch.uint8))
    assert f"{GROUPS[1][0]}.input_global_scale" in served and f"{GROUPS[1][0]}.input_global_scale" not in weight_only


def test_the_modelopt_export_holds_gptq_codes_under_its_own_scales(job):
    """ModelOpt's steps are ``weight_scale * weight_scale_2``, not compressed-tensors' ``scale / global``: its
    codes are rounded under them (from the same Hessians), with ModelOpt's scale tensors as its writer makes them."""
    from converters.serving.modelopt import MODELOPT_NVFP4
    from converters.serving.nvfp4_codes import unpack_codes

    model_dir, out = job
    source = _tensors(model_dir / "model.safetensors")
    served, ct = (_tensors(out / "serving" / name / "model.safetensors") for name in (MODELOPT, W4A4))
    for group in GROUPS:
        amax = _group_amax(source, group)
        for path in group:
            nearest = MODELOPT_NVFP4.quantize(source[f"{path}.weight"], 1.0, torch.bfloat16, weight_amax=amax)
            for index, suffix in ((1, "weight_scale"), (2, "weight_scale_2")):
                assert torch.equal(served[f"{path}.{suffix}"].reshape(-1).view(torch.uint8),
                                   nearest[index].reshape(-1).view(torch.uint8))
            assert not torch.equal(served[f"{path}.weight"], nearest[0])  # rounded codes, ModelOpt's layout
            # its own codes: ModelOpt's block scales are round to nearest's, compressed-tensors' the recipe's
            # four_over_six, so the two exports' codes are rounded under different steps
            assert not torch.equal(unpack_codes(served[f"{path}.weight"]), unpack_codes(ct[f"{path}.weight_packed"]))


def test_the_report_says_what_was_rounded_and_the_artifact_holds_no_rounded_file(job):
    _, out = job
    report = json.loads((out / "fp8_report.json").read_text())
    rounding = report["calibration"]["nvfp4_rounding"]
    assert rounding["method"] == "gptq" and rounding["block_scales"] == "four_over_six" and rounding["act_order"]
    quantized = report["serving"][W4A4]["quantized"]
    assert rounding["weights"] == {"compressed-tensors-nvfp4": len(quantized), "modelopt-nvfp4": len(quantized)}
    assert len(quantized) > 0
    for name in (W4A4, A16, MODELOPT):
        for path in quantized:
            stats = report["serving"][name]["layer_stats"][path]
            assert stats["rounding"] == "gptq" and stats.get("scale_search", "four_over_six") == "four_over_six"
            assert stats["weight_sqnr_db"] > 0 and stats["nearest_weight_sqnr_db"] > 0
            # calibration's meter casts by nearest rounding: its figure is named so, not given as the export's
            assert "nearest_sqnr_db" in stats and "sqnr_db" not in stats
    assert report["recipe"]["nvfp4_weight_rounding"] == "gptq"
    # the CLI's summary line names the rounding beside the (lower by design) weight SQNR
    from service.cli.render import format_serving_exports

    lines = {line.partition(":")[0]: line for line in format_serving_exports(report).splitlines()}
    said = f"(GPTQ-rounded: {len(quantized)} weights, below nearest rounding's by design)"
    assert all(said in lines[f"serving/{name}"] for name in (W4A4, A16))
    assert "GPTQ" not in lines[f"serving/{FP8}"]
    # an FP8 export of the same job is written as ever: nothing of the rounding reaches it
    assert not any("rounding" in stats for stats in report["serving"][FP8]["layer_stats"].values())
    assert not list(out.rglob(f"*{ROUNDED_DIR}*"))
    assert ROUNDED_DIR not in (out / "manifest.json").read_text()


def test_shard_tasks_write_the_same_bytes(tmp_path_factory):
    model_dir = tiny_llama(tmp_path_factory, "nvfp4-gptq-tasks")
    request = ConversionRequest(model=str(model_dir), recipe=RECIPE, serving_formats=(W4A4,), measure=False,
                                calibration=CALIBRATION)
    run = Run(request=request, sources=ModelSourceOptions(allowed_roots=(model_dir.parent,)), sink=NullSink())
    whole, tasks_dir = tmp_path_factory.mktemp("whole"), tmp_path_factory.mktemp("tasks")
    run.staging = whole
    run_stages(run, stop_after=Stage.CONVERT)
    shutil.copytree(whole / ROUNDED_DIR, tasks_dir / ROUNDED_DIR)  # as a shared disk would show it to a worker
    tasks = json.loads(json.dumps(serving_shard_tasks(run, tasks_dir)))
    results = [json.loads(json.dumps(run_serving_write(task["shard"], task["payload"], model_dir, tasks_dir)))
               for task in tasks]
    assert all(task["payload"]["plan"]["rounded"] for task in tasks)
    finish_serving_export(run.serving[W4A4], model_dir, results, tasks_dir / "serving" / W4A4,
                          confinement_for(run.sources),
                          weight_scales="four_over_six")
    # a payload whose rounded-weights file names a path elsewhere is refused, nothing read from there
    hostile = json.loads(json.dumps(tasks[0]))
    key = next(iter(hostile["payload"]["plan"]["rounded"]))
    for file in ("../../model.safetensors", "/etc/passwd", ".."):
        hostile["payload"]["plan"]["rounded"][key] = file
        with pytest.raises(ConversionError, match="is not a file name in the run's rounded-weights directory"):
            run_serving_write(hostile["shard"], hostile["payload"], model_dir, tmp_path_factory.mktemp("hostile"))
    write_serving_exports(run, whole)
    name = f"serving/{W4A4}/model.safetensors"
    assert (whole / name).read_bytes() == (tasks_dir / name).read_bytes()
    assert not (whole / ROUNDED_DIR).exists()


def test_gptq_changes_only_the_codes_it_rounds_and_no_scale_kv_scales_included(tmp_path_factory):
    """GPTQ's extra passes run the layers on the rounded stream: nothing they see may move a scale of the job (they
    once reached the KV-cache recorder and moved the k/v scales of every layer after the first)."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("nvfp4-gptq-kv") / "llama", hidden_size=256, layers=3)
    written = {}
    for rounding in ("nearest", "gptq"):
        out = export(model_dir, (FP8, W4A4), recipe={**RECIPE, "nvfp4_weight_rounding": rounding}, kv_cache="fp8",
                     measure=False, calibration=CalibrationSettings(steps=4, batch_size=2, seq_len=64))
        written[rounding] = {fmt: _tensors(out / "serving" / fmt / "model.safetensors") for fmt in (FP8, W4A4)}
        shutil.move(out, model_dir.parent / f"out-{rounding}")
    nearest, gptq = written["nearest"], written["gptq"]
    assert [key for key in gptq[FP8] if key.endswith(("k_scale", "v_scale"))]  # the job wrote KV scales
    for fmt in (FP8, W4A4):
        assert sorted(nearest[fmt]) == sorted(gptq[fmt])
        differ = sorted(key for key, tensor in gptq[fmt].items() if not torch.equal(tensor, nearest[fmt][key]))
        codes = [key for key in differ if key.endswith(".weight_packed")]
        assert differ == (codes if fmt == W4A4 else []), differ
    assert len(codes) >= 4  # GPTQ chose other codes than nearest rounding in the rounded layers


def test_layers_min_sqnr_db_leaves_out_are_rounded_as_if_excluded_up_front(tmp_path_factory):
    """A Linear that min_sqnr_db keeps in high precision (with its fused group) stays so in GPTQ's stream too: the
    job writes the NVFP4 bytes of the job that excludes the same Linears by name before calibrating."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("nvfp4-gptq-min-sqnr") / "llama", hidden_size=256, layers=3)
    measured = export(model_dir, (W4A4,), recipe=RECIPE)
    outputs = sorted((layer["sqnr_db"]["output"], layer["path"]) for layer in
                     json.loads((measured / "fp8_report.json").read_text())["analysis"]["layers"]
                     if layer.get("sqnr_db") and layer["sqnr_db"].get("output") is not None)
    rounded = {key.removesuffix(".weight_packed") for key in _tensors(measured / "serving" / W4A4 /
                                                                     "model.safetensors") if key.endswith("_packed")}
    # up to the lowest rounded Linear before the last layer: one whose rounding later layers' Hessians would see
    threshold = min(value for value, path in outputs if path in rounded and not path.startswith("model.layers.2.")) \
        + 0.005
    shutil.rmtree(measured)
    by_sqnr = export(model_dir, (W4A4,), recipe=RECIPE, min_sqnr_db=threshold)
    report = json.loads((by_sqnr / "fp8_report.json").read_text())
    excluded = report["analysis"]["sensitivity"]["excluded"]
    assert sorted(excluded) == sorted(path for value, path in outputs if value < threshold)
    shutil.move(by_sqnr, model_dir.parent / "by-sqnr")
    by_name = export(model_dir, (W4A4,), recipe=RECIPE, exclude=tuple(excluded))
    ours, theirs = (_tensors(out / "serving" / W4A4 / "model.safetensors") for out in (model_dir.parent / "by-sqnr",
                                                                                        by_name))
    assert sorted(ours) == sorted(theirs)
    assert [key for key in ours if not torch.equal(ours[key], theirs[key])] == []
    assert report["calibration"]["nvfp4_rounding"]["weights"] == \
        {"compressed-tensors-nvfp4": sum(key.endswith(".weight_packed") for key in ours)}


def test_a_whole_model_calibration_is_refused_naming_the_field(tmp_path_factory):
    model_dir = tiny_llama(tmp_path_factory, "nvfp4-gptq-backward")
    with pytest.raises(RequestError, match="nvfp4_weight_rounding gptq rounds each decoder layer during the "
                                           "layer-sequential calibration") as info:
        export(model_dir, (W4A4,), recipe=RECIPE, measure=False,
               calibration=CalibrationSettings(steps=1, seq_len=16, backward=True))
    assert info.value.field == "recipe.nvfp4_weight_rounding"
    assert not (model_dir.parent / "out").exists()


def test_gptq_without_an_nvfp4_export_is_a_warning(tmp_path_factory):
    model_dir = tiny_llama(tmp_path_factory, "nvfp4-gptq-none")
    out = export(model_dir, ("compressed-tensors-fp8",), recipe=RECIPE, measure=False)
    report = json.loads((out / "fp8_report.json").read_text())
    assert any("nvfp4_weight_rounding gptq applies to the NVFP4 serving exports" in warning
               for warning in report["warnings"])
    assert "nvfp4_rounding" not in report["calibration"]


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_moe_expert_matrices_are_rounded_by_gptq_and_only_their_codes_change(moe_root, name):
    """A MoE model's expert matrices are GPTQ-rounded as its Linears are (each expert from its own routed tokens):
    against the same job with nearest rounding, only packed codes differ, expert matrices among them, and the
    report counts every rounded matrix."""
    written, reports = {}, {}
    for rounding in ("nearest", "gptq"):
        out = moe_root / f"{name}-gptq-{rounding}"
        run_conversion(ConversionRequest(model=str(moe_root / name), serving_formats=(W4A4,), measure=False,
                                         recipe={**RECIPE, "nvfp4_weight_rounding": rounding},
                                         calibration=CalibrationSettings(steps=4, batch_size=2, seq_len=32)),
                       out, ModelSourceOptions(allowed_roots=(moe_root,)))
        written[rounding] = _tensors(out / "serving" / W4A4 / "model.safetensors")
        reports[rounding] = json.loads((out / "fp8_report.json").read_text())
    nearest, gptq = written["nearest"], written["gptq"]
    assert sorted(nearest) == sorted(gptq)
    differ = sorted(key for key, tensor in gptq.items() if not torch.equal(tensor, nearest[key]))
    assert differ and all(key.endswith(".weight_packed") for key in differ), differ
    experts = [key for key in differ if ".experts." in key]
    assert len(experts) > len(differ) // 2, differ  # the experts hold most matrices, and most are rounded
    stats = reports["gptq"]["serving"][W4A4]["layer_stats"]
    assert all(stats[key.removesuffix(".weight_packed")]["rounding"] == "gptq" for key in experts)
    assert not any("expert matrices keep round to nearest" in warning for warning in reports["gptq"]["warnings"])
    rounded = reports["gptq"]["calibration"]["nvfp4_rounding"]["weights"]["compressed-tensors-nvfp4"]
    assert rounded >= len(differ)
