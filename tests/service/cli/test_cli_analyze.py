"""`fp8forge analyze` on each test architecture, its JSON fields, and its errors."""

import json
import subprocess
import sys

import pytest

from service.cli.main import main
from tests.models import TINY_CONFIGS, install_in_hf_cache, minilm_dir

EXPECTED_ELIGIBLE = {"llama": 13, "qwen2": 13, "mistral": 13, "mixtral": 7, "gpt2": 0, "gemma": 13, "bert": 11}


def run_cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_analyze_json_on_each_architecture(name, models_root, capsys):
    code, out, _ = run_cli(capsys, "analyze", str(models_root / name), "--allow-root", str(models_root), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["totals"]["eligible_layers"] == EXPECTED_ELIGIBLE[name]
    assert set(report["layers"][0]) == {
        "path", "class", "in_features", "out_features", "parameters", "dtype", "eligible", "reasons", "group"
    }
    assert all(layer["eligible"] != bool(layer["reasons"]) for layer in report["layers"])


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_analyze_table_on_each_architecture(name, models_root, capsys):
    code, out, _ = run_cli(capsys, "analyze", str(models_root / name), "--allow-root", str(models_root))
    assert code == 0
    assert out.splitlines()[0].split() == ["layer", "class", "in", "out", "params", "fp8", "why", "not"]
    assert f"eligible: {EXPECTED_ELIGIBLE[name]}" in out


def test_analyze_patterns_backend_and_first_last_flags(models_root, capsys):
    code, out, _ = run_cli(
        capsys, "analyze", str(models_root / "llama"), "--allow-root", str(models_root), "--json",
        "--backend", "AO", "--no-skip-first-last", "--exclude", "layers.1", "--include", "*_proj",
    )
    report = json.loads(out)
    verdicts = {layer["path"]: layer["reasons"] for layer in report["layers"]}
    assert code == 0 and report["options"]["backend"] == "ao"
    assert verdicts["model.layers.0.self_attn.q_proj"] == []
    assert verdicts["model.layers.1.mlp.up_proj"] == ["excluded_by_pattern"]
    assert verdicts["lm_head"] == ["not_matched_by_include"]


def test_analyze_real_minilm(capsys):
    directory = minilm_dir()
    code, out, _ = run_cli(capsys, "analyze", str(directory), "--allow-root", str(directory.parent), "--json")
    report = json.loads(out)
    assert code == 0 and report["model"]["model_type"] == "bert"
    assert report["totals"]["linear_layers"] == 37 and report["totals"]["eligible_layers"] == 35


def test_analyze_from_hf_cache(models_root, tmp_path, capsys):
    install_in_hf_cache(models_root / "mixtral", tmp_path, "tiny/mixtral")
    code, out, _ = run_cli(capsys, "analyze", "tiny/mixtral@main", "--cache-dir", str(tmp_path), "--offline", "--json")
    assert code == 0 and json.loads(out)["totals"]["eligible_layers"] == 7


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["analyze", "nobody/nothing", "--offline"], "is not in the HF cache"),
        (["analyze", "/etc"], "outside the allowed roots"),
        (["analyze", "https://example.com/model"], "is a URL"),
        (["analyze", "./"], "no config.json"),
        (["analyze", "org/x", "--offline", "--exclude", "a..b"], "not a dotted module path glob"),
    ],
)
def test_analyze_bad_input_exits_2_with_one_line(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FP8FORGE_ALLOWED_MODEL_ROOTS", raising=False)
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and len(err.strip().splitlines()) == 1


def test_the_built_in_demo_works_in_the_cli_quietly(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    code, out, err = run_cli(capsys, "analyze", "demo/tiny-llama")
    assert code == 0 and "model.layers.0.self_attn.k_proj" in out
    assert err == ""  # its first use builds it, without transformers' progress bars
    assert (tmp_path / "cache" / "fp8forge" / "demo-models" / "tiny-llama" / "config.json").is_file()


def test_gated_repository_error_is_explained(monkeypatch, capsys):
    # No hub is reachable here, so the hub client's own GatedRepoError is raised in its place.
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError

    request = httpx.Request("GET", "https://hub.invalid/api/models/meta-llama/Llama-3.1-8B")

    def gated(*args, **kwargs):
        raise GatedRepoError("403 gated", response=httpx.Response(403, request=request))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", gated)
    code, _, err = run_cli(capsys, "analyze", "meta-llama/Llama-3.1-8B")
    assert code == 2 and "is gated: accept its licence" in err


def test_analyze_imports_neither_torchao_nor_the_service_stack(models_root):
    probe = (
        "import sys; from service.cli.main import main; "
        f"code = main(['analyze', {str(models_root / 'llama')!r}, '--allow-root', {str(models_root)!r}, '--json']); "
        "loaded = [m for m in ('torchao', 'fastapi', 'uvicorn', 'sqlalchemy') if sys.modules.get(m) is not None]; "
        "print('LOADED', loaded, file=sys.stderr); sys.exit(code)"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "LOADED []" in result.stderr
