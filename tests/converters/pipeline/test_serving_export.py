"""Every serving export of a job is audited against the engine's loading rules, and its report block says what
was written: quantized layers with their weight SQNR under the format, KV-cache scales, the audit's verdict."""

from __future__ import annotations

import json

import pytest

from converters.errors import ConversionError
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import (
    KV_CACHE_FORMAT_NAMES,
    SERVING_FORMAT_NAMES,
    CalibrationSettings,
    ConversionRequest,
)
from converters.serving import serving_format

CALIBRATION = CalibrationSettings(steps=2, seq_len=32)


@pytest.fixture(scope="module")
def report(llama_dir):
    out = llama_dir.parent / "out"
    request = ConversionRequest(model=str(llama_dir), recipe={"backend": "ao"}, calibration=CALIBRATION,
                                serving_formats=SERVING_FORMAT_NAMES, kv_cache="fp8")
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(llama_dir.parent,)))
    return json.loads((out / "fp8_report.json").read_text())


@pytest.mark.parametrize("name", SERVING_FORMAT_NAMES)
def test_each_export_reports_its_layers_weight_sqnr(report, name):
    block = report["serving"][name]
    assert block["quantized"] and set(block["layer_stats"]) == set(block["quantized"])
    for path, stats in block["layer_stats"].items():
        # FP8 casts keep about 30 dB of a Gaussian weight, FP4 about 20: a figure far off means a wrong cast
        low = 15 if "nvfp4" in name else 25
        assert low < stats["sqnr_db"]["weight"] < 45, (path, stats)
        # the calibration's meter measured it: the export does not cast every weight a second time for it,
        # except where the format has figures of its own (fp8-block's cost of UE8M0 scales)
        assert ("weight_sqnr_db" in stats) == name.startswith("fp8-block"), (path, stats)


@pytest.mark.parametrize("name", SERVING_FORMAT_NAMES)
def test_each_export_reports_the_output_sqnr_its_casts_give_measured_during_calibration(report, name):
    block = report["serving"][name]
    for path in block["quantized"]:
        sqnr = block["layer_stats"][path]["sqnr_db"]
        assert 8 < sqnr["output"] < 45, (path, sqnr)  # NVFP4 W4A4 around 15 dB, FP8 around 25-30
        if name == "nvfp4-a16":  # weight-only: the input stays in high precision, exactly
            assert sqnr["input"] == 300.0
        else:
            assert sqnr["input"] < 45
    # the same pass measured the job's own recipe: the serving labels stay out of the comparison table
    assert "comparison" not in report["analysis"]


@pytest.mark.parametrize("name", SERVING_FORMAT_NAMES)
def test_each_export_carries_its_load_audit(report, name):
    audit = report["serving"][name]["load_audit"]
    assert audit["format"]
    if audit["audited"]:
        assert audit["ok"] and audit["problems"] == [] and audit["tensors_checked"] > 0
    else:  # a format without rules says so, in the report and in the job's warnings
        assert any(note.startswith("not audited") for note in audit["notes"])
        assert any(f"{name}: the load audit has no rules" in warning for warning in report["warnings"])


def test_kv_cache_scales_are_reported_where_written(report):
    for name in SERVING_FORMAT_NAMES:
        block = report["serving"][name]["kv_cache"]
        if name in KV_CACHE_FORMAT_NAMES:
            assert block and len(block["layers"]) == 2, name  # both attention layers of the tiny llama
        else:
            assert block is None, name


def test_an_export_the_engine_would_misread_fails_the_job_and_leaves_nothing(llama_dir, tmp_path, monkeypatch):
    fmt = serving_format("compressed-tensors-fp8")
    original = fmt.quantization_config

    def with_a_bogus_ignore_entry(plan):
        config = original(plan)
        config["ignore"] = [*config["ignore"], "model.layers.7.mlp.down_proj"]  # no such module
        return config

    monkeypatch.setattr(fmt, "quantization_config", with_a_bogus_ignore_entry)
    out = tmp_path / "out"
    request = ConversionRequest(model=str(llama_dir), recipe={"backend": "ao"}, calibration=CALIBRATION,
                                serving_formats=("compressed-tensors-fp8",))
    with pytest.raises(ConversionError, match="ignored_module_missing: model.layers.7.mlp.down_proj") as info:
        run_conversion(request, out, ModelSourceOptions(allowed_roots=(llama_dir.parent,)))
    assert info.value.field == "serving_formats"
    assert not out.exists() and not list(tmp_path.iterdir())  # no artifact, no staging directory left


def test_measure_false_skips_the_sqnr_meter_and_the_report_says_so(llama_dir, tmp_path):
    out = tmp_path / "out"
    request = ConversionRequest(model=str(llama_dir), recipe={"backend": "ao"}, calibration=CALIBRATION,
                                serving_formats=("nvfp4",), measure=False)
    run_conversion(request, out, ModelSourceOptions(allowed_roots=(llama_dir.parent,)))
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["analysis"]["sensitivity"]["measured"] is False
    assert "measure: false" in report["analysis"]["sensitivity"]["reason"]
    assert not any("sqnr_db" in layer for layer in report["analysis"]["layers"])
    assert report["serving"]["nvfp4"]["layer_stats"] == {}  # nothing measured, at calibration or at export


@pytest.mark.parametrize("asked", [{"min_sqnr_db": 20.0}, {"compare_recipes": ("te-current",)}])
def test_measure_false_refuses_what_needs_the_measurement(asked):
    from converters.errors import RequestError

    with pytest.raises(RequestError, match="measure false turns the SQNR measurement off") as info:
        ConversionRequest(model="org/name", measure=False, **asked)
    assert info.value.field == "measure"
