"""The `fp8forge` console script, run as a user runs it: the built-in demo works, and stderr holds only
fp8forge's own lines (no torchao, torch or transformers start-up noise, no progress bar under --no-progress)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # spawns processes or servers: seconds each

FP8FORGE = Path(sys.executable).with_name("fp8forge")


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    """A user's environment: none of the variables the test suite sets to keep libraries quiet."""
    env = {key: value for key, value in os.environ.items() if key != "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"}
    env["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("user-cache"))
    return env


def fp8forge(env, *argv, cwd=None):
    result = subprocess.run([str(FP8FORGE), *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout, result.stderr


def foreign_lines(stderr: str) -> list[str]:
    """Lines fp8forge did not write: its own are `warning: ...` and `fp8forge <command>: ...`."""
    return [line for line in stderr.splitlines() if not line.startswith(("warning: ", "fp8forge "))]


def test_demo_analyze_works_and_prints_nothing_on_stderr(user_env):
    code, out, err = fp8forge(user_env, "analyze", "demo/tiny-llama")
    assert code == 0 and "model.layers.1.mlp.down_proj" in out
    assert err == ""
    assert (Path(user_env["XDG_CACHE_HOME"]) / "fp8forge" / "demo-models" / "tiny-llama" / "config.json").is_file()


def test_demo_convert_works_and_prints_only_fp8forge_lines(user_env, tmp_path):
    code, out, err = fp8forge(user_env, "convert", "demo/tiny-llama", "--out", str(tmp_path / "out"), "--no-progress",
                              "--backend", "ao", "--calib-steps", "2", "--calib-seq-len", "32")
    assert code == 0, err
    assert "converted 13 layers with backend ao" in out and (tmp_path / "out" / "manifest.json").is_file()
    assert foreign_lines(err) == []


def test_whole_model_te_run_of_a_config_without_dtype_is_quiet(user_env, models_root, tmp_path):
    # Backward calibration loads the whole model through from_pretrained (transformers' "Loading weights" bar),
    # and a config.json without a dtype is where reading config.torch_dtype logged a deprecation.
    model = shutil.copytree(models_root / "llama", tmp_path / "models" / "llama")
    config = json.loads((model / "config.json").read_text())
    del config["dtype"]
    (model / "config.json").write_text(json.dumps(config))
    code, out, err = fp8forge(user_env, "convert", "./models/llama", "--out", str(tmp_path / "out"), "--no-progress",
                              "--calib-backward", "--calib-steps", "2", "--calib-seq-len", "32", cwd=tmp_path)
    assert code == 0, err
    assert "mode: whole-model" in out
    assert foreign_lines(err) == []
    assert "warning: the model ships no tokenizer" in err  # fp8forge's own warnings still show
