"""What a new user meets first, as the README and docs promise it (security issue, item 9).

The command line (`fp8forge --version`, `--out` with missing parents, a relative model path, a recipe whose shape
rule no layer meets, Accelerate keys dropped under `use_mxfp8_block_scaling`, JSON recipes in the API's spelling),
a conversion's warnings and stage timings, the service (`--first-key` on a fresh data directory, `/` -> `/ui`,
the API-key box, an include pattern refused at submit) and the venv (no torchao kernel load failures).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from service.cli.main import main
from service.config import Settings
from tests.service_helpers import ServeProcess, build_tiny_llama, fp8forge_command, free_port, live_app

ROOT = Path(__file__).resolve().parents[3]
FAST = ["--no-progress", "--calib-steps", "1", "--calib-batch-size", "1", "--calib-seq-len", "16"]
# What `accelerate config` writes for TE, with use_mxfp8_block_scaling added by hand.
ACCELERATE_MXFP8 = """mixed_precision: fp8
fp8_config:
  backend: TE
  use_mxfp8_block_scaling: true
  fp8_format: E4M3
  amax_history_length: 1024
  amax_compute_algorithm: max
  interval: 1
  margin: 0
  override_linear_precision: (false, false, false)
  use_autocast_during_eval: false
"""
DROPPED = ("amax_history_length", "amax_compute_algorithm", "interval", "override_linear_precision",
           "use_autocast_during_eval")


@pytest.fixture
def demo_cache(tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.getbasetemp() / "new-user-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


def run_cli(capsys, *argv):
    code = main([str(arg) for arg in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def cli_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FP8FORGE_")}
    return {**env, "XDG_CACHE_HOME": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}


# --- the command line ------------------------------------------------------------------------------------------


def test_version_names_the_installed_package(tmp_path):
    from importlib.metadata import version

    done = subprocess.run([*fp8forge_command(), "--version"], capture_output=True, text=True, timeout=60,
                          env=cli_env(tmp_path))
    assert done.returncode == 0 and done.stdout.strip() == f"fp8forge {version('fp8forge')}"


def test_out_creates_missing_parents_and_a_failed_run_removes_them(demo_cache, tmp_path, capsys):
    code, out, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", tmp_path / "runs" / "a" / "demo",
                             "--backend", "ao", *FAST)
    assert code == 0, err
    assert (tmp_path / "runs" / "a" / "demo" / "manifest.json").is_file()
    code, _, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", tmp_path / "other" / "b" / "demo",
                           "--backend", "ao", "--include", "layers.9", *FAST)
    assert code == 2 and "layers.9" in err
    assert not (tmp_path / "other").exists()  # nothing left behind, not even the parents it made


def test_a_relative_path_to_a_directory_is_told_to_start_with_dot_slash(tmp_path):
    build_tiny_llama(tmp_path / "models" / "tiny")
    done = subprocess.run([*fp8forge_command(), "analyze", "models/tiny@main"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=cli_env(tmp_path))
    assert done.returncode == 2, done.stderr
    assert "./models/tiny is a directory here: write ./models/tiny to use it" in done.stderr, done.stderr
    (tmp_path / "tiny").symlink_to(tmp_path / "models" / "tiny")
    done = subprocess.run([*fp8forge_command(), "analyze", "tiny"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env=cli_env(tmp_path))
    assert done.returncode == 2 and "write ./tiny to use it" in done.stderr
    done = subprocess.run([*fp8forge_command(), "analyze", "./models/tiny"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env=cli_env(tmp_path))
    assert done.returncode == 0, done.stderr


def test_a_recipe_whose_shape_rule_no_layer_meets_is_bad_input_naming_the_rule(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, LlamaConfig

    # every Linear has a dim of 48 or 80: multiples of 16, none of 32
    config = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=3,
                         num_key_value_heads=3, vocab_size=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "m48")
    recipe = tmp_path / "mxfp8.json"
    recipe.write_text(json.dumps({"backend": "te", "scaling": "mxfp8_block"}))
    code, _, err = run_cli(capsys, "convert", tmp_path / "m48", "--out", tmp_path / "out", "--recipe", recipe,
                           "--allow-root", tmp_path, *FAST)
    assert code == 2, err
    assert "both Linear dims divisible by 32" in err and "MXFP8BlockScaling" in err
    assert "dim_not_divisible_by_32_for_mxfp8" in err and "multiples of 16" not in err.replace("16)", "")
    assert not (tmp_path / "out").exists()
    code, _, err = run_cli(capsys, "convert", tmp_path / "m48", "--out", tmp_path / "out", "--allow-root", tmp_path,
                           *FAST)  # TE delayed scaling: multiples of 16 are enough
    assert code == 0, err


def test_accelerate_keys_dropped_under_mxfp8_are_named(demo_cache, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(ACCELERATE_MXFP8)
    code, _, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", tmp_path / "out", "--recipe", config,
                           *FAST)
    assert code == 0, err
    line = next(line for line in err.splitlines() if "use_mxfp8_block_scaling drops" in line)
    assert line.startswith("warning: ") and all(key in line for key in DROPPED)
    report = json.loads((tmp_path / "out" / "fp8_report.json").read_text())
    assert any(all(key in warning for key in DROPPED) for warning in report["warnings"])
    assert report["recipe"]["scaling"] == "mxfp8_block" and not set(DROPPED) & set(report["recipe"])
    code, _, err = run_cli(capsys, "analyze", "demo/tiny-llama", "--recipe", config)
    assert code == 0 and "use_mxfp8_block_scaling drops" in err


@pytest.mark.parametrize(("recipe", "key", "write"), [
    ({"backend": "AO"}, "backend", '"backend": "ao"'),
    ({"backend": "te", "amax_history_length": 16}, "amax_history_length", '"amax_history_len": 16'),
    ({"backend": "te", "use_mxfp8_block_scaling": True, "amax_history_length": 16}, "use_mxfp8_block_scaling",
     '"scaling": "mxfp8_block"'),
    ({"backend": "te", "fp8_format": "e4m3"}, "fp8_format", '"fp8_format": "E4M3"'),
])
def test_a_json_recipe_takes_the_spelling_the_api_takes(recipe, key, write, tmp_path, capsys):
    path = tmp_path / "recipe.json"
    path.write_text(json.dumps(recipe))
    code, _, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", tmp_path / "out", "--recipe", path, *FAST)
    assert code == 2 and f"{key} " in err and f"write {write}" in err, err
    with live_app(Settings(data_dir=tmp_path / "data", auth_disabled=True)) as client:
        answer = client.post("/v1/jobs", json={"model": "demo/tiny-llama", "recipe": recipe})
    assert answer.status_code == 422 and answer.json()["error"]["field"] == f"recipe.{key}"


# --- what a conversion reports ---------------------------------------------------------------------------------


def test_partly_fp8_fused_groups_are_explained_for_serving_and_export_is_timed(demo_cache, tmp_path, capsys):
    code, _, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", tmp_path / "train", "--backend", "ao",
                           *FAST)
    assert code == 0 and "fused group" not in err  # q_proj (first_linear) changes nothing for a training artifact
    report = json.loads((tmp_path / "train" / "fp8_report.json").read_text())
    assert list(report["stage_seconds"]) == ["resolve", "analyze", "calibrate", "convert", "export", "quality"]
    assert report["stage_seconds"]["export"] > 0

    code, _, err = run_cli(capsys, "convert", "demo/tiny-llama", "--out", tmp_path / "served", "--backend", "ao",
                           "--serving", "compressed-tensors-fp8", *FAST)
    assert code == 0, err
    warning = next(line for line in err.splitlines() if "fused group" in line)
    assert "model.layers.0.self_attn.qkv" in warning and "model.layers.0.self_attn.q_proj not eligible" in warning
    assert "serving exports keep the whole group in high precision" in warning
    served = json.loads((tmp_path / "served" / "fp8_report.json").read_text())["serving"]["compressed-tensors-fp8"]
    assert "fused_group_not_fully_eligible" in json.dumps(served["skipped"])  # what the warning says it does


# --- the service -----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(server: ServeProcess, *extra: str):
    """``fp8forge serve`` of ``server`` (its port, data dir and environment) with ``extra`` arguments."""
    cmd = [*fp8forge_command(), "serve", "--host", "127.0.0.1", "--port", str(server.port), "--workers",
           str(server.workers), *extra]
    with server.log.open("ab") as log:
        server.proc = subprocess.Popen(cmd, env=server.env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_first_key_lets_a_fresh_data_directory_start_with_keys_on(tmp_path):
    data = tmp_path / "data"
    refused = subprocess.run([*fp8forge_command(), "serve", "--workers", "0", "--port", str(free_port())],
                             capture_output=True, text=True, timeout=60,
                             env={**cli_env(tmp_path), "FP8FORGE_DATA_DIR": str(data)})
    assert refused.returncode == 2 and "fp8forge keys create NAME" in refused.stderr  # without it: says how

    server = ServeProcess(data, workers=0, env={"FP8FORGE_AUTH_DISABLED": "0"})
    with serving(server, "--first-key", "admin"):
        token = re.search(r"^(fp8f_\S+)$", server.tail(), re.M).group(1)
        assert httpx.get(f"{server.base_url}/v1/jobs", timeout=10).status_code == 401
        answer = httpx.get(f"{server.base_url}/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert answer.status_code == 200
    lines = (data / "api_keys").read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("admin:admin:") and token not in lines[0]
    with serving(server, "--first-key", "admin"):  # the second start finds the key: nothing new is made or printed
        assert len(re.findall(r"^fp8f_", server.tail(), re.M)) == 1
        answer = httpx.get(f"{server.base_url}/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=10)
        assert answer.status_code == 200
    assert (data / "api_keys").read_text().splitlines() == lines
    assert '"--first-key", "admin"]' in (ROOT / "Dockerfile").read_text()  # what the image runs


def test_root_leads_to_the_ui_and_the_key_box_shows_only_where_keys_are_on(tmp_path):
    with live_app(Settings(data_dir=tmp_path / "open", auth_disabled=True)) as client:
        answer = client.get("/", follow_redirects=False)
        assert answer.status_code == 307 and answer.headers["location"] == "/ui"
        assert client.get("/", follow_redirects=True).url.path == "/ui/jobs"
        assert 'id="api-key"' not in client.get("/ui/jobs").text
    from service.api.auth import hash_token

    keyed = Settings(data_dir=tmp_path / "keyed", api_keys=[f"alice:user:{hash_token('fp8f_x')}"])
    with live_app(keyed) as client:
        assert 'id="api-key"' in client.get("/ui/jobs").text


# --- the venv --------------------------------------------------------------------------------------------------


def test_importing_torchao_prints_no_kernel_load_failure(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TORCHAO_FORCE_SKIP_LOADING_SO_FILES"}
    done = subprocess.run([sys.executable, "-c", "import torchao, transformers"], capture_output=True, text=True,
                          timeout=180, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stderr and "Could not load this library" not in done.stderr, (
        f"{done.stderr}\nrun `make install` (tools/prune_torchao_kernels.py removes the kernels torch cannot load)")


def test_the_prune_keeps_only_kernels_that_load(tmp_path):
    spec = importlib.util.spec_from_file_location("prune", ROOT / "tools" / "prune_torchao_kernels.py")
    prune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prune)
    for name in ("_C_cutlass_90a.abi3.so", "_C_mxfp8.cpython-310-x86_64-linux-gnu.so", "other.so"):
        (tmp_path / name).touch()
    names = lambda **kw: [p.name for p in prune.unloadable_kernels(tmp_path, **kw)]  # noqa: E731
    assert names(cuda=False, python=(3, 11)) == ["_C_cutlass_90a.abi3.so", "_C_mxfp8.cpython-310-x86_64-linux-gnu.so"]
    assert names(cuda=True, python=(3, 11)) == ["_C_mxfp8.cpython-310-x86_64-linux-gnu.so"]
    assert names(cuda=True, python=(3, 10)) == []
