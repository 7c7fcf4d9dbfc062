"""End to end on CPU: `fp8forge convert` with torchao (each recipe) and TE, artifacts reloaded."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from converters.artifact.files import sha256_file, verify_manifest
from converters.backends.cpu_fp8_gemm import torch_fp8_gemms
from converters.backends.loaders import load_torchao
from converters.backends.te.layout import TE_STATE_NAMES, state_key
from converters.calibration.amax import LayerAmax, te_scaling_state
from converters.errors import ArtifactError
from converters.model.sources import ModelSourceOptions, load_model
from converters.recipes import recipe_from_dict
from service.cli.main import main
from tests.models import minilm_dir, save_tiny_model

SMALL_CALIBRATION = ["--calib-steps", "3", "--calib-seq-len", "32", "--no-progress"]


def convert(root, model, out, *extra):
    return main(["convert", str(model), "--out", str(out), "--allow-root", str(root), *SMALL_CALIBRATION, *extra])


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchao_recipes_convert_reload_and_train(llama_root, tmp_path, recipe_name):
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"backend": "ao", "recipe_name": recipe_name}))
    out = llama_root / f"ao-{recipe_name}"
    assert convert(llama_root, llama_root / "llama", out, "--recipe", str(recipe)) == 0

    model = load_torchao(out)
    converted = [name for name, module in model.named_modules() if type(module).__name__ == "Float8Linear"]
    config = json.loads((out / "config.json").read_text())["fp8"]
    assert converted == config["converted_modules"] and len(converted) == 13
    assert config["float8_linear_config"]["cast_config_input"]["scaling_granularity"] == (
        "tensorwise" if recipe_name == "tensorwise" else "axiswise"
    )

    ids = torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(1))
    original = load_model(llama_root / "llama", ModelSourceOptions())
    cosine = torch.nn.functional.cosine_similarity(logits(model, ids).flatten(), logits(original, ids).flatten(), dim=0)
    assert cosine >= 0.99

    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss) and model.model.layers[1].mlp.up_proj.weight.grad is not None


def test_te_checkpoint_layout_and_state_equal_the_recorded_calibration(llama_root, tmp_path):
    recipe = tmp_path / "te.json"
    recipe.write_text(json.dumps({"backend": "te", "amax_history_len": 4, "amax_compute_algo": "max", "margin": 1}))
    out = llama_root / "te"
    assert convert(llama_root, llama_root / "llama", out, "--recipe", str(recipe), "--calib-backward") == 0

    state = load_file(out / "fp8_state.safetensors")
    calibration = load_file(out / "fp8_calibration.safetensors")
    assert sha256_file(out / "model.safetensors") == sha256_file(llama_root / "llama" / "model.safetensors")
    block = json.loads((out / "config.json").read_text())["fp8"]
    assert block["te_modules_built"] is False and len(block["converted_modules"]) == 13
    assert block["state_file"] == "fp8_state.safetensors"

    parsed = recipe_from_dict(block["recipe"])
    for path in block["converted_modules"]:
        layer = LayerAmax(forward=calibration[f"{path}.amax_forward"], backward=calibration[f"{path}.amax_backward"])
        expected = te_scaling_state(layer, parsed)
        for name in TE_STATE_NAMES:
            assert torch.equal(state[state_key(path, name)], expected[name]), (path, name)
        assert state[state_key(path, "amax_history_fwd")].shape == (4, 3)
        assert state[state_key(path, "scale_bwd")].shape == (2,)
        assert state[state_key(path, "scale_fwd")][1] != 1.0  # the weight slot was calibrated
    assert len(state) == 4 * 13
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["calibration"]["steps"] == 3 and "built-in corpus" in report["calibration"]["data_source"]
    assert report["pipeline"]["mode"] == "whole_model" and "backward" in report["pipeline"]["reason"]
    assert any("TransformerEngine modules were not built here" in warning for warning in report["warnings"])
    with safe_open(out / "fp8_state.safetensors", "pt") as handle:
        metadata = handle.metadata()
    assert json.loads(metadata["fp8_recipe"])["amax_history_len"] == 4 and metadata["version_torch"]
    # every file of an artifact gets the mode of a new file here (safetensors itself creates 0600 files)
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir() if path.is_file()}
    assert len(set(modes.values())) == 1 and "fp8_state.safetensors" in modes, modes


@pytest.mark.parametrize("recipe_name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_real_minilm_torchao_recipes(tmp_path, recipe_name):
    directory = minilm_dir()
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"backend": "ao", "recipe_name": recipe_name}))
    out = tmp_path / "ao"
    assert main(["convert", str(directory), "--out", str(out), "--allow-root", str(directory.parent),
                 "--recipe", str(recipe), *SMALL_CALIBRATION]) == 0
    verify_manifest(out)
    report = json.loads((out / "fp8_report.json").read_text())
    assert len(report["converted_modules"]) == 35 and "tokenizer.json" in report["files"]
    assert "built-in corpus" in report["calibration"]["data_source"]

    model = load_torchao(out)
    ids = torch.tensor([[101, 7592, 2088, 102] * 4])
    original = load_model(directory, ModelSourceOptions())
    with torch.no_grad():
        reference = original(input_ids=ids).last_hidden_state
    model.eval()  # no dropout in the comparison
    # the FP8 GEMMs' results, not oneDNN's slow reference kernel on a CPU with AMX (cpu_fp8_gemm)
    with torch_fp8_gemms():
        with torch.no_grad():
            output = model(input_ids=ids).last_hidden_state
        cosine = torch.nn.functional.cosine_similarity(output.flatten(), reference.flatten(), dim=0)
        assert cosine >= 0.99
        model.train()
        model(input_ids=ids).last_hidden_state.float().pow(2).mean().backward()
    assert model.encoder.layer[1].attention.self.query.weight.grad is not None


def test_real_minilm_te_files_are_the_source_files(tmp_path):
    from converters.backends.te.loader import read_te_artifact

    directory = minilm_dir()
    out = tmp_path / "te"
    assert main(["convert", str(directory), "--out", str(out), "--allow-root", str(directory.parent),
                 "--backend", "te", *SMALL_CALIBRATION]) == 0
    artifact = read_te_artifact(out)
    # Byte for byte, even the position_ids buffer that transformers 5 no longer saves.
    assert sha256_file(out / "model.safetensors") == sha256_file(directory / "model.safetensors")
    assert sorted(artifact.scaling_states) == sorted(artifact.converted_modules)
    assert len(artifact.converted_modules) == 35
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["pipeline"]["mode"] == "layer_sequential" and "BertLayer" in report["pipeline"]["reason"]
    model = load_model(out, ModelSourceOptions(allowed_roots=(out,)))
    query = "encoder.layer.0.attention.self.query.weight"
    assert torch.equal(model.get_parameter(query), load_file(directory / "model.safetensors")[query])


def test_sharded_source_keeps_its_shards_and_index(tmp_path):
    from converters.model.demo import build_demo_tokenizer, build_tiny_llama
    from converters.pipeline.driver import NullSink, run_conversion
    from converters.pipeline.request import CalibrationSettings, ConversionRequest

    source = tmp_path / "sharded"
    load_model(build_tiny_llama(tmp_path / "llama"), ModelSourceOptions()).save_pretrained(
        source, max_shard_size="100KB")
    build_demo_tokenizer().save_pretrained(source)
    files = sorted(path.name for path in source.glob("model*.safetensors*"))
    assert len(files) >= 3  # at least two shards and the index
    request = ConversionRequest(model=str(source), recipe={"backend": "ao"},
                                calibration=CalibrationSettings(steps=2, seq_len=16))
    sink = NullSink()
    run_conversion(request, tmp_path / "out", ModelSourceOptions(allowed_roots=(tmp_path,)), sink)
    assert sorted(path.name for path in (tmp_path / "out").glob("model*.safetensors*")) == files
    assert all(sha256_file(tmp_path / "out" / name) == sha256_file(source / name) for name in files)
    assert len(load_torchao(tmp_path / "out").model.layers) == 2


def test_tied_weights_are_stored_once(tmp_path):
    save_tiny_model("gemma", tmp_path / "gemma")
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "gemma"), "--out", str(out), "--allow-root", str(tmp_path),
                 "--backend", "ao", *SMALL_CALIBRATION]) == 0
    weights = load_file(out / "model.safetensors")
    assert "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights
    assert json.loads((out / "config.json").read_text())["fp8"]["tied_weights"] == {
        "lm_head.weight": "model.embed_tokens.weight"
    }
    model = load_torchao(out)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    report = json.loads((out / "fp8_report.json").read_text())
    assert any("random token ids" in warning for warning in report["warnings"])


def test_altered_or_escaping_artifact_is_refused(llama_root, tmp_path):
    out = tmp_path / "ao"
    assert convert(llama_root, llama_root / "llama", out, "--backend", "ao") == 0
    with open(out / "fp8_report.json", "a") as handle:
        handle.write(" ")
    with pytest.raises(ArtifactError, match="differs from manifest.json"):
        load_torchao(out)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"][0]["name"] = "../../etc/passwd"
    (out / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="not a file name inside the artifact"):
        verify_manifest(out)


@pytest.mark.parametrize(
    ("extra", "message", "expected_code"),
    [
        (["--calib-seq-len", "100000"], "--calib-seq-len must be an integer from 1 to", 2),
        (["--calib-seq-len", "1000"], "exceeds the model's max_position_embeddings 512", 2),
        (["--calib-steps", "0"], "--calib-steps must be an integer", 2),
        (["--backend", "ao", "--exclude", "*"], "no layer is eligible", 2),
    ],
)
def test_failed_run_leaves_no_output(llama_root, extra, message, expected_code, capsys):
    out = llama_root / "failed"
    args = ["convert", str(llama_root / "llama"), "--out", str(out), "--allow-root", str(llama_root), "--no-progress"]
    code = main([*args, *extra])
    err = capsys.readouterr().err
    assert code == expected_code and message in err
    assert not out.exists() and not (llama_root / ".failed.partial").exists()


def test_recipe_file_errors_exit_2(llama_root, tmp_path, capsys):
    recipe = tmp_path / "bad.json"
    recipe.write_text(json.dumps({"backend": "te", "amax_history_lenght": 4}))
    code = main(["convert", str(llama_root / "llama"), "--out", str(tmp_path / "o"), "--allow-root", str(llama_root),
                 "--recipe", str(recipe)])
    err = capsys.readouterr().err
    assert code == 2 and "amax_history_lenght" in err and not (tmp_path / "o").exists()


def test_accelerate_config_yaml_drives_a_te_conversion(llama_root, tmp_path, capsys):
    config = tmp_path / "config.yaml"
    config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: MULTI_GPU\nmixed_precision: fp8\n"
        "fp8_config:\n  amax_compute_algo: most_recent\n  amax_history_len: 8\n  backend: TE\n"
        "  fp8_format: E4M3\n  interval: 1\n  margin: 0\n  override_linear_precision: (false, false, false)\n"
        "  use_autocast_during_eval: false\n"
    )
    out = tmp_path / "te-yaml"
    assert main(["convert", str(llama_root / "llama"), "--out", str(out), "--allow-root", str(llama_root),
                 "--recipe", str(config), *SMALL_CALIBRATION]) == 0
    report = json.loads((out / "fp8_report.json").read_text())
    assert report["recipe"]["amax_compute_algo"] == "most_recent" and report["recipe"]["fp8_format"] == "E4M3"
    assert any("interval" in warning and "no effect" in warning for warning in report["warnings"])
    state = load_file(out / "fp8_state.safetensors")
    assert state[state_key("model.layers.1.mlp.up_proj", "amax_history_fwd")].shape == (8, 3)


def test_seed_ao_yaml_with_fsdp_all_gather_converts_and_loads(llama_root, tmp_path):
    """The seed's AO example turns on enable_fsdp_float8_all_gather, which wraps weights in a tensor subclass."""
    config = tmp_path / "config.yaml"
    config.write_text("mixed_precision: fp8\nfp8_config:\n  backend: AO\n  enable_fsdp_float8_all_gather: true\n"
                      "  pad_inner_dim: true\n")
    out = tmp_path / "ao-fsdp"
    assert convert(llama_root, llama_root / "llama", out, "--recipe", str(config)) == 0
    model = load_torchao(out)
    assert json.loads((out / "config.json").read_text())["fp8"]["float8_linear_config"]["enable_fsdp_float8_all_gather"]
    original = load_file(llama_root / "llama" / "model.safetensors")
    assert torch.equal(load_file(out / "model.safetensors")["model.layers.1.mlp.up_proj.weight"],
                       original["model.layers.1.mlp.up_proj.weight"])
    ids = torch.randint(0, 300, (2, 16))
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_analyze_then_convert_in_one_process(llama_root, tmp_path, capsys):
    assert main(["analyze", str(llama_root / "llama"), "--allow-root", str(llama_root), "--json"]) == 0
    assert convert(llama_root, llama_root / "llama", tmp_path / "out", "--backend", "ao") == 0


def test_encoder_decoder_model_calibrates(tmp_path):
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                      decoder_start_token_id=0)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    out = tmp_path / "out"
    assert main(["convert", str(tmp_path / "t5"), "--out", str(out), "--allow-root", str(tmp_path),
                 "--backend", "te", *SMALL_CALIBRATION]) == 0
    report = json.loads((out / "fp8_report.json").read_text())
    amax = report["calibration"]["layers"]["decoder.block.0.layer.0.SelfAttention.k"]["amax_forward"]
    assert all(step[0] > 0 for step in amax)  # the decoder ran on every step
