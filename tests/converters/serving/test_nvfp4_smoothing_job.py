"""A job whose recipe asks ``nvfp4_smoothing: awq`` smooths its source before calibration and converts the smoothed
model: the artifact's weights compute the source's function (every tensor the smoothing did not change is the
source's, byte for byte), the NVFP4 export carries the smoothed norms, the report says per mapping what was smoothed,
kept or skipped and why, the smoothed copy never reaches the artifact, and a job that cannot smooth is refused
naming the field (or warned, where no W4A4 export would use it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from converters.calibration.smoothing_walk import FOLD_TOLERANCE, _scales_outputs
from converters.errors import RequestError
from converters.model.demo import build_tiny_llama
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import run_conversion
from converters.pipeline.progress import progress_event
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.pipeline.source_smoothing import SMOOTHED_SOURCE_DIR
from converters.pipeline.state import NullSink
from tests.converters.serving.exports import export

RECIPE = {"backend": "ao", "nvfp4_smoothing": "awq"}
FORMATS = ("nvfp4", "compressed-tensors-fp8")


class _Progress(NullSink):
    """Records each progress event's text, as the API words it."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str] = []
        self.stage_name = ""

    def stage(self, name: str) -> None:
        self.stage_name = name

    def progress(self, done: int, total: int, unit: Any = "step", **detail: Any) -> None:
        self.texts.append(progress_event(self.stage_name, done, total, unit, **detail)["text"])


@pytest.fixture(scope="module", params=[2, 4], ids=["gqa", "mha"])
def job(request, tmp_path_factory):
    model_dir = build_tiny_llama(tmp_path_factory.mktemp(f"smooth-{request.param}") / "llama", kv_heads=request.param)
    out, sink = model_dir.parent / "out", _Progress()
    run_conversion(ConversionRequest(model=str(model_dir), recipe=RECIPE, serving_formats=FORMATS,
                                     calibration=CalibrationSettings(steps=2, seq_len=32)),
                   out, ModelSourceOptions(allowed_roots=(model_dir.parent,)), sink)
    return model_dir, out, json.loads((out / "fp8_report.json").read_text()), sink.texts


def test_progress_names_the_search_and_the_copy_before_calibration_counts_its_layers(job):
    texts = job[3]
    search = texts.index("calibrate: 1/2 layers, now searching each layer's NVFP4 smoothing scales")
    copy = texts.index("calibrate: 0/1 step, now writing the smoothed copy of the source")
    assert search < copy < texts.index("calibrate: 1/2 layers", copy)


def _logits(directory: Path, weights: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory), dtype=torch.float32)
    model.load_state_dict({name: tensor.float() for name, tensor in load_file(weights).items()})
    with torch.no_grad():
        return model.eval()(ids).logits


def test_the_artifact_is_the_smoothed_model_and_computes_the_source_function(job):
    model_dir, out, report, _ = job
    source, smoothed = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    block = report["calibration"]["nvfp4_smoothing"]
    changed = {name for name in source if not torch.equal(source[name], smoothed[name])}
    assert block["applied"] and block["changed_tensors"] == len(changed) > 0
    assert {name for name in changed if name.endswith("norm.weight")}  # the scales moved into the norms
    # every tensor the smoothing did not touch passes through as the source's bytes
    assert all(source[name].dtype == smoothed[name].dtype for name in source) and source.keys() == smoothed.keys()
    ids = torch.randint(0, 200, (2, 24), generator=torch.Generator().manual_seed(1))
    before = _logits(model_dir, model_dir / "model.safetensors", ids)
    after = _logits(model_dir, out / "model.safetensors", ids)
    assert float((after - before).norm() / before.norm()) < 0.02


def test_the_report_names_each_mapping_and_the_chosen_scales_lower_the_error(job):
    model_dir, _, report, _ = job
    mha = json.loads((model_dir / "config.json").read_text())["num_key_value_heads"] == 4
    block = report["calibration"]["nvfp4_smoothing"]
    records = {(record["layer"], record["feeder"].rpartition(".")[2]): record for record in block["layers"]}
    # q_proj is the model's first Linear: the fused q/k/v stays in high precision
    assert records[(0, "input_layernorm")]["result"] == "skipped: a Linear of the group is not converted"
    for record in block["layers"]:
        if record["result"] == "smoothed":
            assert record["smoothed_error"] < record["error"] and 0 <= record["output_change"] <= FOLD_TOLERANCE
        elif record["result"].startswith("kept"):
            assert record["smoothed_error"] == record["error"]
    v_to_o = records[(1, "v_proj")]["result"]
    assert v_to_o.startswith(("smoothed", "kept")) if mha else "grouped-query attention" in v_to_o
    counts = block["mappings"]
    assert block["seconds"]["search"] > 0 and block["seconds"]["copy"] > 0
    assert sum(counts.values()) == len(block["layers"]) == 8 and counts["smoothed"] >= 3
    assert any("the job converts the smoothed model" in warning for warning in report["warnings"])
    from service.cli.render import format_quality, format_serving_exports

    assert format_serving_exports(report).splitlines()[0] == (
        f"nvfp4_smoothing awq: {counts['smoothed']} mapping(s) smoothed, {counts['kept']} kept, {counts['skipped']} "
        "skipped; every export holds the smoothed model")
    assert "source (smoothed)" in format_quality(report)  # the quality pass's reference is the model converted


def test_the_nvfp4_export_carries_the_smoothed_norms_and_no_copy_reaches_the_artifact(job):
    model_dir, out, _, _ = job
    smoothed, served = load_file(out / "model.safetensors"), load_file(out / "serving" / "nvfp4" / "model.safetensors")
    norms = [name for name in smoothed if name.endswith("norm.weight")]
    assert all(torch.equal(served[name], smoothed[name]) for name in norms)
    assert not any(SMOOTHED_SOURCE_DIR in str(path) or "smoothing-layers" in str(path) for path in out.rglob("*"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert not any("smooth" in entry["name"] for entry in manifest["files"])


def test_a_whole_model_calibration_is_refused_naming_the_field(tmp_path_factory):
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("smooth-backward") / "llama")
    with pytest.raises(RequestError, match="nvfp4_smoothing awq searches each decoder layer during a "
                                           "layer-sequential walk") as info:
        export(model_dir, ("nvfp4",), recipe=RECIPE, measure=False,
               calibration=CalibrationSettings(steps=1, seq_len=16, backward=True))
    assert info.value.field == "recipe.nvfp4_smoothing"
    assert not (model_dir.parent / "out").exists()


def test_without_a_w4a4_export_it_is_a_warning_and_the_source_is_converted_as_it_is(tmp_path_factory):
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("smooth-a16") / "llama")
    out = export(model_dir, ("nvfp4-a16",), recipe=RECIPE, measure=False,
                 calibration=CalibrationSettings(steps=1, seq_len=16))
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["calibration"]["nvfp4_smoothing"]["applied"] is False
    assert any("nvfp4_smoothing awq applies to the NVFP4 W4A4 serving exports" in warning
               for warning in report["warnings"])
    assert (out / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_a_norm_that_does_not_scale_by_its_weight_takes_no_fold():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    assert _scales_outputs(LlamaRMSNorm(64))
    gemma = GemmaRMSNorm(64)
    torch.nn.init.normal_(gemma.weight)
    assert not _scales_outputs(gemma)


def test_a_calibrated_analysis_says_it_measured_the_source_as_it_is(tmp_path_factory):
    from converters.pipeline.sync_analysis import calibrated_analysis

    model_dir = build_tiny_llama(tmp_path_factory.mktemp("smooth-analysis") / "llama")
    request = ConversionRequest(model=str(model_dir), recipe=RECIPE, serving_formats=("nvfp4",),
                                calibration=CalibrationSettings(steps=1, seq_len=16))
    report = calibrated_analysis(request, ModelSourceOptions(allowed_roots=(model_dir.parent,)))
    assert any("nvfp4_smoothing awq runs in conversion jobs: this analysis measured the source as it is" in warning
               for warning in report["warnings"])
    assert report["sensitivity"]["measured"]
    assert sorted(path.name for path in model_dir.parent.iterdir()) == ["llama"]  # nothing written beside it


def test_with_no_mapping_to_smooth_the_source_is_converted_as_it_is(tmp_path_factory):
    """Only o_proj converted (v -> o is grouped-query attention here): the walk changes nothing and no copy is made."""
    model_dir = build_tiny_llama(tmp_path_factory.mktemp("smooth-nothing") / "llama")
    out = export(model_dir, ("nvfp4",), recipe=RECIPE, measure=False, exclude=("mlp", "q_proj", "k_proj", "v_proj"),
                 calibration=CalibrationSettings(steps=1, seq_len=16))
    block = json.loads((out / "fp8_report.json").read_text())["calibration"]["nvfp4_smoothing"]
    assert block["applied"] and block["changed_tensors"] == 0 and block["mappings"]["smoothed"] == 0
    assert (out / "model.safetensors").read_bytes() == (model_dir / "model.safetensors").read_bytes()


def test_a_resumable_one_rank_job_smooths_and_publishes_the_one_process_bytes(job, tmp_path):
    from converters.distributed import run_ranked_conversion
    from converters.distributed.ranks import RankInfo

    model_dir, out, _, _ = job
    ranked = model_dir.parent / "out-ranked"
    run_ranked_conversion(ConversionRequest(model=str(model_dir), recipe=RECIPE, serving_formats=FORMATS,
                                            calibration=CalibrationSettings(steps=2, seq_len=32)),
                          ranked, ModelSourceOptions(allowed_roots=(model_dir.parent,)), info=RankInfo(),
                          resume_dir=tmp_path / "record")
    for name in ("model.safetensors", *(f"serving/{fmt}/model.safetensors" for fmt in FORMATS)):
        assert (ranked / name).read_bytes() == (out / name).read_bytes(), name
    report = json.loads((ranked / "fp8_report.json").read_text())
    assert report["calibration"]["nvfp4_smoothing"]["applied"]
