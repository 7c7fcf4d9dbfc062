"""The amax swing of stateless recipes: read from the amax calibration records, in the job report and the CLI."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from converters.calibration.amax import LayerAmax, record_amax
from converters.calibration.result import AMAX_SWING_THRESHOLD, amax_swing, amax_swing_line
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import ConversionRequest, run_conversion
from converters.pipeline.request import CalibrationSettings
from tests.service_helpers import fp8forge_command


def _layer(inputs: list[float]) -> LayerAmax:
    forward = torch.zeros(len(inputs), 3)
    forward[:, 0] = torch.tensor(inputs)
    forward[:, 1] = 1.0
    return LayerAmax(forward=forward)


def test_swing_is_max_over_median_of_the_steps_a_layer_ran():
    block = amax_swing({"steady": _layer([1.0, 1.1, 0.9, 1.05]), "spiky": _layer([1.0, 1.0, 8.0, 0.0, 1.2]),
                        "idle": _layer([0.0, 0.0])}, stateless=True)
    steady, spiky, idle = (block["layers"][name] for name in ("steady", "spiky", "idle"))
    assert steady == {"max_over_median": pytest.approx(1.1 / 1.0, abs=1e-4), "steps": 4, "matters": False}
    # the step where the layer did not run (amax 0) is not a step of its own
    assert spiky == {"max_over_median": 8.0, "steps": 4, "matters": True}
    assert idle == {"max_over_median": None, "steps": 0, "matters": False}
    assert block["matters"] == ["spiky"] and block["threshold"] == AMAX_SWING_THRESHOLD
    line = amax_swing_line(block)
    assert "1 of 3 layers" in line and "spiky 8.00x" in line and "stateless" in line


def test_swing_of_a_real_calibration_follows_the_data():
    """One step holding a token whose embedding has an outlier channel (RMSNorm keeps it an outlier) makes that
    step's input amax, and the layer's swing, grow; the same steps without it stay steady."""
    from transformers import AutoModelForCausalLM

    from tests.models import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    generator = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 128, (2, 16), generator=generator)} for _ in range(4)]
    path = "model.layers.0.self_attn.q_proj"
    calm = amax_swing(record_amax(model, [path], batches), stateless=True)["layers"][path]
    with torch.no_grad():
        model.model.embed_tokens.weight[200, 0] = 100.0  # an outlier channel, as trained LMs have
    batches[2]["input_ids"][0, 5] = 200
    loud = amax_swing(record_amax(model, [path], batches), stateless=True)["layers"][path]
    assert calm["steps"] == loud["steps"] == 4 and not calm["matters"]
    assert loud["max_over_median"] > 2 * calm["max_over_median"] and loud["matters"]


def test_job_report_and_cli_summary_carry_the_swing(tmp_path):
    sources = ModelSourceOptions(demo_dir=tmp_path / "demo")
    request = ConversionRequest(model="demo/tiny-llama", recipe={"backend": "te", "scaling": "current"},
                                calibration=CalibrationSettings(steps=3, seq_len=16), measure=False)
    result = run_conversion(request, tmp_path / "out", sources)
    report = json.loads(result.report_path.read_text())
    swing = report["amax_swing"]
    assert swing["recipe_stateless"] is True and set(swing["layers"]) == set(result.converted)
    for path, entry in swing["layers"].items():
        inputs = torch.tensor(report["calibration"]["layers"][path]["amax_forward"])[:, 0]
        assert entry["steps"] == 3
        assert entry["max_over_median"] == pytest.approx(float(inputs.max() / inputs.median()), abs=1e-4)

    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([*fp8forge_command(), "convert", "demo/tiny-llama", "--out", str(tmp_path / "cli"),
                           "--calib-steps", "2", "--calib-seq-len", "16", "--no-progress", "--no-measure"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "amax swing:" in done.stdout
