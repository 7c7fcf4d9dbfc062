"""A recipe's own shape rule drives the conversion and the CLI analysis, not only the report of a bare analysis."""

from __future__ import annotations

import json
import subprocess

from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import ConversionRequest, run_conversion
from converters.pipeline.request import CalibrationSettings
from tests.service_helpers import fp8forge_command

BLOCK = {"backend": "te", "scaling": "float8_block"}


def test_a_block_scaled_conversion_skips_the_layers_its_rule_refuses(tmp_path):
    sources = ModelSourceOptions(demo_dir=tmp_path / "demo")
    request = ConversionRequest(model="demo/tiny-llama", recipe=BLOCK,
                                calibration=CalibrationSettings(steps=2, seq_len=16))
    result = run_conversion(request, tmp_path / "out", sources)
    report = json.loads(result.report_path.read_text())
    reasons = {layer["path"]: layer["reasons"] for layer in report["analysis"]["layers"]}
    # the demo's k/v projections are 128 -> 64: whole 128x128 blocks do not fit
    assert reasons["model.layers.1.self_attn.k_proj"] == ["dim_not_divisible_by_128_for_fp8_block"]
    assert reasons["model.layers.1.self_attn.q_proj"] == []
    assert "model.layers.1.self_attn.q_proj" in result.converted
    assert "model.layers.1.self_attn.k_proj" not in result.converted
    assert not (tmp_path / "out" / "fp8_state.safetensors").exists()  # stateless: nothing to seed


def test_cli_analyze_applies_the_recipe_file_shape_rule(tmp_path):
    recipe = tmp_path / "block.json"
    recipe.write_text(json.dumps(BLOCK))
    env_free = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*fp8forge_command(), "analyze", "demo/tiny-llama", "--recipe", str(recipe), "--json"],
                          capture_output=True, text=True, timeout=180, env=env_free)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    skipped = [layer["path"] for layer in report["layers"]
               if "dim_not_divisible_by_128_for_fp8_block" in layer["reasons"]]
    assert "model.layers.0.self_attn.v_proj" in skipped and report["options"]["recipe"]["scaling"] == "float8_block"


def test_the_recipe_is_parsed_once_per_request() -> None:
    from converters.analysis.eligibility import AnalysisOptions, options_recipe
    from converters.pipeline.request import ConversionRequest

    request = ConversionRequest(model="demo/tiny-llama", recipe={"backend": "te", "scaling": "current"})
    recipe = request.parsed_recipe()
    assert request.parsed_recipe() is recipe  # every stage reads the object __post_init__ parsed
    options = AnalysisOptions(recipe=recipe)
    assert options_recipe(options) is recipe and options.recipe == recipe.to_dict()
