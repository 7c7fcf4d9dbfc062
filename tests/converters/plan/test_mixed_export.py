"""A plan's mixed-precision serving checkpoints (compressed-tensors ``mixed-precision``, ModelOpt ``MIXED_PRECISION``):
each planned layer's tensors are the bytes its single-format export writes for it, everything else the source's
bytes; transformers with compressed-tensors loads the compressed-tensors one on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from converters.errors import Fp8ForgeError, ModelConfigError
from converters.model.files import FileConfinement
from converters.model.sources import ModelSourceOptions, load_model
from converters.pipeline.request import CalibrationSettings
from converters.plan.candidates import BF16
from converters.plan.mixed_export import (
    COMPRESSED_TENSORS_MIXED,
    MIXED_LAYOUTS,
    MODELOPT_MIXED,
    not_expressible,
    write_mixed_checkpoint,
)
from tests.converters.serving.exports import cosine, export

#: per layout, the single-format export of each precision, written by the same job (same calibration)
SINGLE = {layout.name: {precision: fmt.name for precision, fmt in layout.serving_of.items()}
          for layout in MIXED_LAYOUTS}
MIN_SQNR_DB = 18.0


@pytest.fixture(scope="module")
def job(llama_dir):
    """One job with a plan for a B200 and the single-format exports of every precision: (artifact dir, report)."""
    formats = tuple(name for singles in SINGLE.values() for name in singles.values())
    out = export(llama_dir, formats, calibration=CalibrationSettings(steps=2, seq_len=32),
                 plan={"min_sqnr_db": MIN_SQNR_DB, "gpu": "b200"})
    return out, json.loads((out / "fp8_report.json").read_text())


def tensors(path):
    with safe_open(str(path), "pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118 (safe_open has no __iter__)


def same_bytes(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                         b.reshape(-1).view(torch.uint8))


def check_layers_match_single_exports(layout, directory, artifact, plan, source_dir):
    """Each planned layer's tensors equal its precision's single-format export's; every other tensor the source's."""
    mixed = tensors(directory / "model.safetensors")
    source = tensors(source_dir / "model.safetensors")
    singles = {precision: tensors(artifact / "serving" / name / "model.safetensors") for precision, name in
               SINGLE[layout.name].items()}
    owned, replaced = set(), set()
    for row in plan["layers"]:
        if row["precision"] == BF16:
            continue
        prefix = f"{row['path']}."
        single = {key: value for key, value in singles[row["precision"]].items() if key.startswith(prefix)}
        assert len(single) >= 2, row["path"]  # the weight (or its packed form) and its scales
        for key, value in single.items():
            assert same_bytes(mixed[key], value), key
        owned |= set(single)
        replaced.add(f"{prefix}weight")
    passed = {key for key in source if key not in replaced}
    for key in passed:
        assert same_bytes(mixed[key], source[key]), key
    assert set(mixed) == owned | passed


def load_and_compare(directory, source_dir):
    import transformers
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(json.loads((directory / "config.json").read_text())
                                               ["quantization_config"])
    assert config.format == "mixed-precision"
    model, info = transformers.AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not any(info[kind] for kind in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = load_model(source_dir, ModelSourceOptions())(input_ids=ids).logits
        served = model.eval()(input_ids=ids).logits
    return model, cosine(served, reference)


def test_the_jobs_mixed_checkpoints_hold_each_layer_as_its_single_format_export(llama_dir, job):
    out, report = job
    plan = report["plan"]
    chosen = {row["precision"] for row in plan["layers"]}
    assert BF16 in chosen and chosen - {BF16}, chosen  # a real mix: some layers bf16, some quantized
    listed = {entry["name"] for entry in json.loads((out / "manifest.json").read_text())["files"]}
    for layout in MIXED_LAYOUTS:
        block = plan["mixed_checkpoints"][layout.name]
        left = not_expressible(plan, layout)
        assert block["written"] == (not left), block  # written unless a layer's precision has no writer there
        if left:
            assert all(precision in block["reason"] for precision in left), block
            continue
        check_layers_match_single_exports(layout, out / block["directory"], out, plan, llama_dir)
        assert set(block["files"]) <= listed and set(block["files"]) <= set(plan["files"])
    assert plan["mixed_checkpoints"][COMPRESSED_TENSORS_MIXED.name]["written"]


def test_transformers_loads_the_jobs_mixed_checkpoint_with_a_group_per_precision(llama_dir, job):
    out, report = job
    plan = report["plan"]
    directory = out / plan["mixed_checkpoints"][COMPRESSED_TENSORS_MIXED.name]["directory"]
    model, similarity = load_and_compare(directory, llama_dir)
    config = json.loads((directory / "config.json").read_text())["quantization_config"]
    low = {row["precision"] for row in plan["layers"]} - {BF16}
    assert len(config["config_groups"]) == len(low)
    for row in plan["layers"]:
        scheme = getattr(model.get_submodule(row["path"]), "quantization_scheme", None)
        assert (scheme is None) == (row["precision"] == BF16), row["path"]
    # measured 0.99 on this model with the plan's layers at SQNR >= 18 dB
    assert similarity >= 0.97


def plan_by_hand(report, precisions):
    """The job's plan rows with the units' precisions cycling over ``precisions`` (bf16 included)."""
    rows = [dict(row) for row in report["plan"]["layers"]]
    units = list(dict.fromkeys(row["unit"] for row in rows if row["planned"]))
    precision_of = {unit: precisions[index % len(precisions)] for index, unit in enumerate(units)}
    for row in rows:
        row["precision"] = precision_of.get(row["unit"], BF16)
    return {"layers": rows}


def write_by_hand(layout, plan, report, llama_dir, directory):
    # the calibration's input amax, shared per fused group, as the job's single-format exports used it
    amax = report["serving"][SINGLE[layout.name]["fp8-current"]]["input_amax"]
    return write_mixed_checkpoint(layout, plan, llama_dir, [llama_dir / "model.safetensors"], directory,
                                  torch.bfloat16, FileConfinement(roots=(llama_dir.parent,)),
                                  on_disk_name=lambda name: name, input_amax=amax)


def test_every_compressed_tensors_precision_at_once_from_a_plan_written_by_hand(llama_dir, job, tmp_path):
    """fp8-current, mxfp8 and nvfp4 units side by side with bf16 ones."""
    out, report = job
    plan = plan_by_hand(report, [*COMPRESSED_TENSORS_MIXED.serving_of, BF16])
    assert {row["precision"] for row in plan["layers"]} == {"fp8-current", "mxfp8", "nvfp4", BF16}
    write_by_hand(COMPRESSED_TENSORS_MIXED, plan, report, llama_dir, tmp_path / "mixed")
    check_layers_match_single_exports(COMPRESSED_TENSORS_MIXED, tmp_path / "mixed", out, plan, llama_dir)
    _, similarity = load_and_compare(tmp_path / "mixed", llama_dir)
    assert similarity >= 0.95  # NVFP4 W4A4 on a third of the units; measured 0.98


def test_modelopt_mixed_names_each_layers_algorithm(llama_dir, job, tmp_path):
    out, report = job
    plan = plan_by_hand(report, ["nvfp4", "fp8-current", BF16])
    written = write_by_hand(MODELOPT_MIXED, plan, report, llama_dir, tmp_path / "modelopt")
    assert "hf_quant_config.json" in written
    check_layers_match_single_exports(MODELOPT_MIXED, tmp_path / "modelopt", out, plan, llama_dir)
    quantization = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())["quantization"]
    assert quantization["quant_algo"] == "MIXED_PRECISION"
    for row in plan["layers"]:
        algo = quantization["quantized_layers"].get(row["path"], {}).get("quant_algo")
        assert algo == {"fp8-current": "FP8", "nvfp4": "NVFP4"}.get(row["precision"]), row["path"]
        assert (row["path"] in quantization["exclude_modules"]) == (row["precision"] == BF16), row["path"]


@pytest.mark.parametrize(("layout", "precision"), [(COMPRESSED_TENSORS_MIXED, "fp8-block"), (MODELOPT_MIXED, "mxfp8")])
def test_a_precision_the_layout_cannot_hold_is_named_and_refused(llama_dir, tmp_path, layout, precision):
    rows = [{"path": "model.layers.1.mlp.down_proj", "unit": "model.layers.1.mlp.down_proj", "precision": precision},
            {"path": "model.layers.1.mlp.gate_proj", "unit": "g", "precision": "fp8-current"}]
    assert not_expressible({"layers": rows}, layout) == {precision: ["model.layers.1.mlp.down_proj"]}
    with pytest.raises(Fp8ForgeError, match=f"{precision}: model.layers.1.mlp.down_proj") as caught:
        write_mixed_checkpoint(layout, {"layers": rows}, llama_dir, [llama_dir / "model.safetensors"],
                               tmp_path / "m", torch.bfloat16, FileConfinement(roots=(llama_dir.parent,)),
                               on_disk_name=lambda name: name, input_amax={})
    assert caught.value.field == "plan" and not (tmp_path / "m").exists()


def test_a_missing_input_amax_is_refused_naming_the_layer(llama_dir, tmp_path):
    rows = [{"path": "model.layers.1.mlp.down_proj", "unit": "model.layers.1.mlp.down_proj", "precision": "nvfp4"}]
    with pytest.raises(Fp8ForgeError, match="model.layers.1.mlp.down_proj"):
        write_mixed_checkpoint(COMPRESSED_TENSORS_MIXED, {"layers": rows}, llama_dir,
                               [llama_dir / "model.safetensors"], tmp_path / "m", torch.bfloat16,
                               FileConfinement(roots=(llama_dir.parent,)), on_disk_name=lambda name: name,
                               input_amax={})


def test_a_planned_weight_holding_nan_is_refused_as_the_serving_export_refuses_it(llama_dir, tmp_path):
    """The mixed checkpoint converts each weight as the serving export does, finiteness check included: a damaged
    source weight is named, not written as NaN codes."""
    source = tmp_path / "damaged"
    source.mkdir()
    (source / "config.json").write_text((llama_dir / "config.json").read_text())
    weights = tensors(llama_dir / "model.safetensors")
    damaged = "model.layers.1.mlp.down_proj"
    weights[f"{damaged}.weight"] = weights[f"{damaged}.weight"].clone()
    weights[f"{damaged}.weight"][0, 0] = float("nan")
    save_file(weights, source / "model.safetensors")
    rows = [{"path": damaged, "unit": damaged, "precision": "mxfp8"}]
    with pytest.raises(ModelConfigError, match=f"{damaged}.weight holds NaN") as caught:
        write_mixed_checkpoint(COMPRESSED_TENSORS_MIXED, {"layers": rows}, source, [source / "model.safetensors"],
                               tmp_path / "m", torch.bfloat16, FileConfinement(roots=(tmp_path,)),
                               on_disk_name=lambda name: name, input_amax={})
    assert caught.value.field == "model"
