"""``fp8forge sync`` as a user runs it: the console script in a subprocess, its output, exit codes and files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from converters.model.demo import build_tiny_llama
from converters.model.sources import ModelSourceOptions
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import CalibrationSettings, ConversionRequest

FP8FORGE = Path(sys.executable).with_name("fp8forge")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("sync-cli")
    build_tiny_llama(base / "llama")
    request = ConversionRequest(model=str(base / "llama"), recipe={"backend": "te", "scaling": "float8_block"},
                                measure=False, calibration=CalibrationSettings(steps=1, seq_len=16))
    run_conversion(request, base / "artifact", ModelSourceOptions(allowed_roots=(base,)))
    return base / "artifact"


def _run(*argv: str | Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
    return subprocess.run([str(FP8FORGE), *map(str, argv)], capture_output=True, text=True, env=env, timeout=300)


def test_sync_writes_the_twin_and_says_whose_casts_it_holds(artifact):
    out = artifact.parent / "serving"
    result = _run("sync", artifact, "--out", out)
    assert result.returncode == 0, result.stderr
    assert "fp8-block-ue8m0-te: cast" in result.stdout
    assert "bit-identical to the casts of TransformerEngine Float8BlockScaling" in result.stdout
    assert "ran in FP8 in training but stay in high precision" in result.stdout  # layer 0's k/v (q was skipped)
    report = json.loads((out / "sync_report.json").read_text())
    assert report["serving"]["fp8-block-ue8m0-te"]["training_twin"]["identical"] is True
    assert {"config.json", "model.safetensors", "manifest.json", "tokenizer.json"} <= {p.name for p in out.iterdir()}


def test_sync_to_another_format_says_it_is_not_the_twin(artifact):
    result = _run("sync", artifact, "--out", artifact.parent / "other", "--format", "fp8-block")
    assert result.returncode == 0, result.stderr
    assert "not the training twin (that is fp8-block-ue8m0-te)" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (("--format", "compressed-tensors-fp8"), "static input scales"),
    (("--format", "no-such-format"), "unknown target format 'no-such-format'"),
    (("--weights", "/nonexistent-weights"), "/nonexistent-weights"),
    ((), "not an fp8forge training artifact"),
])
def test_bad_input_exits_2_with_the_reason_and_writes_nothing(artifact, args, message, capsys):
    """In-process (``main``, as the console script calls it): one subprocess per case would cost a start-up each."""
    from service.cli.main import main

    out = artifact.parent / "refused"
    source = artifact if args else artifact.parent / "llama"  # no args: a plain model, not an artifact
    assert main(["sync", str(source), "--out", str(out), *args]) == 2
    error = capsys.readouterr().err
    assert error.startswith("fp8forge sync: error:") and message in error
    assert not out.exists()
