"""What `fp8forge analyze` / `convert` tell a user: flags rather than API fields, bad selections refused,
short calibration text warned about, suggestions that name real flags and settings, sizes in the model's dtype."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from service.cli.main import build_parser, main
from service.config import ENV_PREFIX, Settings

SMALL = ["--no-progress", "--backend", "ao", "--calib-steps", "1", "--calib-batch-size", "1"]


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def command_flags(command: str) -> set[str]:
    parser = build_parser()
    subparsers = next(action for action in parser._actions if action.dest == "command")
    return {flag for action in subparsers.choices[command]._actions for flag in action.option_strings}


def assert_suggestions_are_real(message: str) -> None:
    """Every flag named for analyze/convert is theirs, no flag is offered to the service, and every
    FP8FORGE_* name is a setting of the service."""
    settings = {f"{ENV_PREFIX}{name.upper()}" for name in Settings.model_fields}
    for name in re.findall(r"\bFP8FORGE_[A-Z_]+", message):
        assert name in settings, name
    for flag in re.findall(r"(?<![\w-])--[a-z][a-z-]*", message):
        assert flag in command_flags("analyze") and flag in command_flags("convert"), flag
    for service_part in re.findall(r"the service: ([^;)]*)", message):
        assert "--" not in service_part, service_part


@pytest.mark.parametrize(
    ("extra", "flag_message"),
    [
        (["--calib-steps", "0"], "--calib-steps must be an integer from 1 to "),
        (["--calib-batch-size", "999"], "--calib-batch-size must be an integer from 1 to 256"),
        (["--calib-seq-len", "1000"], "--calib-seq-len 1000 exceeds the model's max_position_embeddings 512"),
        (["--serving", "gguf"], "--serving: unknown serving format 'gguf'"),
        (["--exclude", "a..b"], "--exclude: pattern 'a..b' is not a dotted module path glob"),
    ],
)
def test_convert_errors_name_the_flag_not_the_api_field(extra, flag_message, demo_cache, tmp_path, capsys):
    code, _, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", str(tmp_path / "out"), *SMALL, *extra)
    assert code == 2 and flag_message in err
    assert not re.search(r"calibration\.|serving_formats|exclude\[", err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["analyze", "convert"])
def test_an_include_pattern_that_matches_no_linear_is_bad_input(command, demo_cache, tmp_path, capsys):
    out_args = ["--out", str(tmp_path / "out"), *SMALL] if command == "convert" else []
    code, out, err = run_cli(capsys, command, "demo/tiny-llama", *out_args, "--include", "q_proj",
                             "--include", "layers.7")
    assert code == 2 and out == ""
    assert "--include: pattern 'layers.7' matches no Linear layer" in err
    assert "model.layers." in err  # an example of this model's paths
    assert not (tmp_path / "out").exists()


def test_an_include_pattern_that_matches_converts(demo_cache, tmp_path, capsys):
    code, out, _ = run_cli(capsys, "convert", "demo/tiny-llama", "--out", str(tmp_path / "out"), *SMALL,
                           "--include", "layers.1.mlp")
    assert code == 0 and "converted 3 layers" in out


def test_calibration_text_shorter_than_one_window_is_warned_about(demo_cache, tmp_path, capsys):
    texts = tmp_path / "texts.txt"
    texts.write_text("FP8 keeps a scale per tensor.\n\nA second short paragraph.\n")
    code, _, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", str(tmp_path / "short"), *SMALL,
                           "--calib-texts", str(texts), "--calib-seq-len", "64")
    warning = next(line for line in err.splitlines() if "fewer than one window" in line)
    assert code == 0
    assert re.match(r"warning: the calibration text holds \d+ tokens, fewer than one window of --calib-seq-len 64",
                    warning)
    assert "give more --calib-texts or a smaller --calib-seq-len" in warning
    report = json.loads((tmp_path / "short" / "fp8_report.json").read_text())
    assert any("fewer than one window of calibration.seq_len 64" in line for line in report["warnings"])

    code, _, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", str(tmp_path / "fits"), *SMALL,
                           "--calib-texts", str(texts), "--calib-seq-len", "8")
    assert code == 0 and "fewer than one window" not in err


def test_outside_roots_message_names_only_real_flags_and_settings(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FP8FORGE_ALLOWED_MODEL_ROOTS", raising=False)
    code, _, err = run_cli(capsys, "analyze", "/etc")
    assert code == 2 and "outside the allowed roots" in err
    assert "FP8FORGE_ALLOWED_MODEL_ROOTS" in err and "--allow-root" in err
    assert_suggestions_are_real(err)
    assert "--allow-root" not in command_flags("serve")  # which is why the message keeps it to analyze/convert


def test_remote_code_message_names_only_real_flags_and_settings(tmp_path, capsys):
    model = tmp_path / "remote"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "custom-thing", "architectures": ["CustomModel"],
                                                   "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    code, _, err = run_cli(capsys, "analyze", str(model), "--allow-root", str(tmp_path))
    assert code == 2 and "--trust-remote-code" in err and "FP8FORGE_TRUST_REMOTE_CODE" in err
    assert_suggestions_are_real(err)


def test_offline_cache_miss_says_offline_mode_is_on(tmp_path, capsys):
    code, _, err = run_cli(capsys, "analyze", "nobody/nothing", "--offline", "--cache-dir", str(tmp_path))
    assert code == 2
    assert f"'nobody/nothing' is not in the HF cache ({tmp_path}) and offline mode is on" in err
    assert f"`hf download nobody/nothing --cache-dir {tmp_path}`" in err
    assert "could not be reached" not in err
    assert_suggestions_are_real(err)


def test_unreachable_hub_is_not_blamed_on_offline_mode(tmp_path):
    # A real huggingface_hub against a port nothing listens on, offline mode off everywhere.
    env = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "FP8FORGE_HF_OFFLINE")}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    result = subprocess.run(
        [sys.executable, "-m", "service.cli.main", "analyze", "nobody/nothing@v1", "--cache-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "is not in the HF cache" in result.stderr and "the hub could not be reached (ConnectError" in result.stderr
    assert f"`hf download nobody/nothing --revision v1 --cache-dir {tmp_path}`" in result.stderr
    assert "offline" not in result.stderr


def test_hf_hub_offline_in_the_service_environment_is_named(tmp_path, monkeypatch):
    # The service's own offline setting is off, but huggingface_hub obeys HF_HUB_OFFLINE by itself.
    from huggingface_hub import constants

    from converters.errors import ModelNotFoundError
    from converters.model.sources import ModelSourceOptions, resolve_model_dir

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir("nobody/nothing", ModelSourceOptions(cache_dir=tmp_path, offline=False), with_weights=False)
    assert "HF_HUB_OFFLINE is set in the environment" in info.value.message
    assert "unset HF_HUB_OFFLINE" in info.value.message and "offline mode is on" not in info.value.message


@pytest.mark.parametrize(("model", "dtype", "itemsize"), [("llama", "float32", 4), ("demo", "bfloat16", 2)])
def test_analyze_prints_sizes_in_the_models_dtype(model, dtype, itemsize, models_root, demo_cache, capsys):
    ref = "demo/tiny-llama" if model == "demo" else str(models_root / model)
    code, out, _ = run_cli(capsys, "analyze", ref, "--allow-root", str(models_root))
    assert code == 0 and f" in {dtype} (the model's dtype) -> " in out and "bf16" not in out
    code, out, _ = run_cli(capsys, "analyze", ref, "--allow-root", str(models_root), "--json")
    totals = json.loads(out)["totals"]
    assert totals["weight_dtype"] == dtype and totals["weight_bytes"] == itemsize * totals["model_parameters"]
    assert totals["weight_bytes_with_fp8"] == totals["weight_bytes"] - (itemsize - 1) * totals["fp8_parameters"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_te_conversion_on_cpu_succeeds_and_says_what_it_did_not_do(demo_cache, tmp_path, capsys):
    code, out, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", str(tmp_path / "out"), "--no-progress",
                             "--calib-steps", "1", "--calib-batch-size", "1")
    assert code == 0 and "converted 13 layers with backend te" in out
    assert (tmp_path / "out" / "fp8_state.safetensors").is_file()
    warning = next(line for line in err.splitlines() if "TransformerEngine modules were not built here" in line)
    assert "no CUDA device" in warning and "no FP8 check step ran" in warning and "compute capability 8.9" in warning
    assert "GPU worker" not in warning and "pip install" not in warning  # the job needed neither
