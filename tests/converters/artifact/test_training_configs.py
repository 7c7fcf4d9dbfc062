"""training/ beside a training artifact: each config read back by its framework's own code where it installs on a
CPU (Accelerate), checked against the fields read from the framework's source elsewhere, and the one-step script run."""

import ast
import dataclasses
import fnmatch
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import yaml

from converters.artifact.files import verify_manifest
from converters.artifact.training import read_training_decisions, training_files
from converters.artifact.training.accelerate import accelerate_selection
from converters.artifact.training.torchtitan import TORCHTITAN_NAMES
from converters.recipes import (
    AOMXFP8TrainingOpRecipe,
    TECurrentScalingRecipe,
    TEMXFP8BlockScalingRecipe,
    TENVFP4BlockScalingRecipe,
    TorchAORecipe,
    recipe_from_accelerate_yaml,
)
from service.cli.main import main

SMALL = ["--calib-steps", "2", "--calib-seq-len", "32", "--no-progress"]
#: MixedPrecisionConfig's fields (Megatron-Bridge 067f987 src/megatron/bridge/training/mixed_precision.py) that the
#: override may set, with the values its docstrings and get_fp8_recipe accept; the module imports TE, so it cannot be
#: imported here.
MEGATRON_FIELDS = {"fp8": {"hybrid", "e4m3"}, "fp8_recipe": {"tensorwise", "delayed", "mxfp8", "blockwise"},
                   "fp8_margin": int, "fp8_amax_history_len": int, "fp8_amax_compute_algo": {"max", "most_recent"},
                   "first_last_layers_bf16": bool, "num_layers_at_start_in_bf16": int,
                   "num_layers_at_end_in_bf16": int, "fp4": {"e2m1"}, "fp4_recipe": {"nvfp4"}}
#: Float8LinearConverter.Config / MXFP8LinearConverter.Config fields (torchtitan 0.3.0 components/quantization/)
TORCHTITAN_FIELDS = {"Float8LinearConverter": {"recipe_name", "filter_fqns", "emulate", "model_compile_enabled"},
                     "MXFP8LinearConverter": {"fqns", "model_compile_enabled"}}


def convert(root, out, *extra):
    return main(["convert", str(root / "llama"), "--out", str(out), "--allow-root", str(root), *SMALL, *extra])


@pytest.fixture(scope="module")
def artifacts(llama_root):
    ao, te = llama_root / "ao", llama_root / "te"
    assert convert(llama_root, ao, "--backend", "ao") == 0
    assert convert(llama_root, te, "--backend", "te") == 0
    return {"ao": ao, "te": te}


def accelerate_env(config_path):
    """What `accelerate launch --config_file config_path` exports to the training process (Accelerate's own code)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import setup_fp8_env

    args = launch_command_parser().parse_args(["--config_file", str(config_path), "train.py"])
    _validate_launch_command(args)
    assert args.mixed_precision == "fp8"
    return setup_fp8_env(args, {})


def test_export_writes_training_configs_in_the_manifest(artifacts):
    names = {entry["name"] for entry in verify_manifest(artifacts["te"])}
    assert {"training/accelerate_config.yaml", "training/megatron_bridge.yaml", "training/te_precision_config.yaml",
            "training/train_one_step.py", "training/README.md"} <= names
    assert "training/accelerate_config.yaml" in {entry["name"] for entry in verify_manifest(artifacts["ao"])}


def test_accelerate_reads_the_te_config(artifacts):
    from accelerate.commands.config.config_args import load_config_from_file

    path = artifacts["te"] / "training" / "accelerate_config.yaml"
    loaded = load_config_from_file(str(path))
    assert loaded.mixed_precision == "fp8" and loaded.fp8_config["backend"] == "TE"
    env = accelerate_env(path)
    recipe = read_training_decisions(artifacts["te"]).recipe
    assert env["ACCELERATE_FP8_BACKEND"] == "TE" and env["ACCELERATE_FP8_FORMAT"] == recipe.fp8_format.value
    assert env["ACCELERATE_FP8_AMAX_HISTORY_LEN"] == str(recipe.amax_history_len)
    assert env["ACCELERATE_FP8_AMAX_COMPUTE_ALGO"] == recipe.amax_compute_algo.value  # Accelerate's default differs
    assert env["ACCELERATE_FP8_USE_MXFP8_BLOCK_SCALING"] == "False"
    assert recipe_from_accelerate_yaml(path.read_text()).to_dict() == recipe.to_dict()
    # Accelerate's TE path converts q_proj and lm_head, which the artifact keeps: the file says so, by name
    assert "Accelerate converts lm_head" in path.read_text()
    assert "Accelerate converts model.layers.0.self_attn.q_proj" in path.read_text()


def test_accelerate_builds_its_te_recipe_kwargs_where_te_imports(artifacts, monkeypatch):
    from accelerate.utils import TERecipeKwargs
    from accelerate.utils.imports import is_transformer_engine_available

    if not is_transformer_engine_available():
        pytest.skip("Accelerate's TERecipeKwargs raises ImportError without TransformerEngine (CUDA only)")
    for name, value in accelerate_env(artifacts["te"] / "training" / "accelerate_config.yaml").items():
        monkeypatch.setenv(name, value)
    kwargs, recipe = TERecipeKwargs(), read_training_decisions(artifacts["te"]).recipe
    assert (kwargs.fp8_format, kwargs.amax_history_len, kwargs.amax_compute_algo, kwargs.margin) == (
        recipe.fp8_format.value, recipe.amax_history_len, recipe.amax_compute_algo.value, recipe.margin)


def test_accelerate_builds_its_torchao_recipe_from_the_ao_config(artifacts, monkeypatch):
    from accelerate.utils import AORecipeKwargs
    from accelerate.utils.ao import filter_linear_layers, find_first_last_linear_layers
    from torch import nn

    from converters.backends.loaders import load_torchao

    path = artifacts["ao"] / "training" / "accelerate_config.yaml"
    env = accelerate_env(path)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    kwargs = AORecipeKwargs()  # reads the ACCELERATE_FP8_* variables the launcher exported
    recipe = read_training_decisions(artifacts["ao"]).recipe
    assert env["ACCELERATE_FP8_BACKEND"] == "AO"
    assert (kwargs.config.pad_inner_dim, kwargs.config.enable_fsdp_float8_all_gather) == (
        recipe.pad_inner_dim, recipe.enable_fsdp_float8_all_gather)
    # the layers Accelerate's own filter picks are the ones the file's comment was computed from
    model = load_torchao(artifacts["ao"])
    first, last = find_first_last_linear_layers(model)
    theirs = {name for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and filter_linear_layers(module, name, layers_to_filter=[first, last])}
    assert theirs == accelerate_selection(read_training_decisions(artifacts["ao"]))
    assert "nothing: Accelerate's own layer choice equals the artifact's" in path.read_text()


def test_accelerate_mxfp8_config_and_the_recipes_it_cannot_express(artifacts):
    decisions = read_training_decisions(artifacts["te"])
    mxfp8 = dataclasses.replace(decisions, recipe=TEMXFP8BlockScalingRecipe(margin=1))
    files, _ = training_files(mxfp8)
    document = yaml.safe_load(files["accelerate_config.yaml"])
    assert document["fp8_config"] == {"backend": "TE", "use_mxfp8_block_scaling": True, "fp8_format": "E4M3",
                                      "margin": 1}
    assert recipe_from_accelerate_yaml(files["accelerate_config.yaml"]) == TEMXFP8BlockScalingRecipe(margin=1)
    for recipe in (TECurrentScalingRecipe(), TENVFP4BlockScalingRecipe(), TorchAORecipe(recipe_name="rowwise"),
                   AOMXFP8TrainingOpRecipe()):
        files, notes = training_files(dataclasses.replace(decisions, recipe=recipe))
        assert "accelerate_config.yaml" not in files
        assert any(note.startswith("accelerate_config.yaml: not written") and recipe.library_class in note
                   for note in notes)


def test_megatron_override_uses_mixed_precision_config_fields(artifacts):
    decisions = read_training_decisions(artifacts["te"])
    for recipe in (decisions.recipe, TECurrentScalingRecipe(), TEMXFP8BlockScalingRecipe(),
                   TENVFP4BlockScalingRecipe()):
        files, _ = training_files(dataclasses.replace(decisions, recipe=recipe))
        fields = yaml.safe_load(files["megatron_bridge.yaml"])["mixed_precision"]
        for name, value in fields.items():
            allowed = MEGATRON_FIELDS[name]
            assert value in allowed if isinstance(allowed, set) else type(value) is allowed, (name, value)
    fields = yaml.safe_load(training_files(decisions)[0]["megatron_bridge.yaml"])["mixed_precision"]
    assert fields["fp8_recipe"] == "delayed" and fields["fp8_amax_history_len"] == decisions.recipe.amax_history_len


def test_whole_blocks_in_high_precision_become_megatron_block_counts(artifacts):
    decisions = read_training_decisions(artifacts["te"])
    last_block = [dataclasses.replace(linear, fp8=False, reasons=("excluded",)) if ".layers.1." in linear.path
                  else linear for linear in decisions.linears]
    files, _ = training_files(dataclasses.replace(decisions, linears=tuple(last_block)))
    fields = yaml.safe_load(files["megatron_bridge.yaml"])["mixed_precision"]
    assert (fields["first_last_layers_bf16"], fields["num_layers_at_start_in_bf16"],
            fields["num_layers_at_end_in_bf16"]) == (True, 0, 1)
    precision = yaml.safe_load(files["te_precision_config.yaml"])
    patterns = [matcher["pattern"] for matcher in precision["matchers"].values()]
    assert patterns == ["*decoder.layers.0.self_attention.linear_qkv"]  # block 1 is counted, not listed


def test_te_precision_file_selects_exactly_the_kept_modules(artifacts):
    precision = yaml.safe_load((artifacts["te"] / "training" / "te_precision_config.yaml").read_text())
    names = [f"decoder.layers.{i}.{module}" for i in range(2) for module in
             ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    # Megatron-Core's GlobMatcher is fnmatch.fnmatch over the module path (quant_config.py)
    matched = [name for name in names
               if any(fnmatch.fnmatch(name, m["pattern"]) for m in precision["matchers"].values())]
    assert matched == ["decoder.layers.0.self_attention.linear_qkv"]
    assert precision["configs"]["bf16"] == {"transformer_engine_config_type": "TEQuantizationParams",
                                            "training_recipe": {}}


@pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                    reason="megatron-core is a peer, not a dependency: run with megatron-core on PYTHONPATH")
def test_megatron_core_parses_the_te_precision_file(artifacts):
    from megatron.core.extensions.transformer_engine import TEQuantizationParams
    from megatron.core.quantization.quant_config import MatchContext, RecipeConfig

    recipe = RecipeConfig.from_yaml_file(str(artifacts["te"] / "training" / "te_precision_config.yaml"))
    match = recipe.match(MatchContext("decoder.layers.0.self_attention.linear_qkv", 1))
    params = TEQuantizationParams.parse_from_config(match)
    assert params.training_recipe.fp8_quantization_recipe is None  # BF16 for this module
    assert params.training_recipe.fp4_quantization_recipe is None
    assert recipe.match(MatchContext("decoder.layers.1.self_attention.linear_qkv", 2)) is None


def test_torchtitan_converters_for_rowwise_and_mxfp8(artifacts):
    decisions = read_training_decisions(artifacts["ao"])
    assert "torchtitan_converters.py" not in training_files(decisions)[0]  # tensorwise: torchtitan has no such recipe
    for recipe, cls in ((TorchAORecipe(recipe_name="rowwise"), "Float8LinearConverter"),
                        (AOMXFP8TrainingOpRecipe(), "MXFP8LinearConverter")):
        text = training_files(dataclasses.replace(decisions, recipe=recipe))[0]["torchtitan_converters.py"]
        call = next(node for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Call))
        assert ast.unparse(call.func) == f"{cls}.Config"
        keywords = {keyword.arg: ast.literal_eval(keyword.value) for keyword in call.keywords}
        assert set(keywords) <= TORCHTITAN_FIELDS[cls]
        if cls == "Float8LinearConverter":
            assert keywords["recipe_name"] == "rowwise"
            assert keywords["filter_fqns"] == ["layers.0.attention.qkv_linear.wq", "lm_head"]
        else:
            assert len(keywords["fqns"]) == 13 and "lm_head" not in keywords["fqns"]


@pytest.mark.skipif(importlib.util.find_spec("torchtitan") is None,
                    reason="torchtitan is a peer, not a dependency: run with torchtitan on PYTHONPATH")
def test_torchtitan_names_are_its_own_adapter_names():
    """Read torchtitan's Llama 3 adapter's from_hf_map from its source (importing it needs torchtitan's distributed
    dependencies)."""
    package = importlib.util.find_spec("torchtitan").submodule_search_locations[0]
    source = open(os.path.join(package, "models", "llama3", "state_dict_adapter.py"), encoding="utf-8").read()
    assignment = next(node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
                      and ast.unparse(node.targets[0]) == "self.from_hf_map")
    from_hf_map = ast.literal_eval(assignment.value)
    assert all(from_hf_map[f"{hf}.weight"] == f"{titan}.weight" for hf, titan in TORCHTITAN_NAMES.items())


def test_train_one_step_script_runs_on_the_ao_artifact(artifacts):
    script = artifacts["ao"] / "training" / "train_one_step.py"
    assert len(script.read_text().splitlines()) == 10
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    loss = float(done.stdout.strip().rsplit(" ", 1)[1])
    assert loss == loss and 0 < loss < 20  # finite: log(256) is 5.5 for the tiny Llama's vocabulary


def test_train_one_step_script_runs_on_the_te_artifact(artifacts):
    from converters.backends.te.runtime import te_status

    ok, why = te_status()
    if not ok:
        pytest.skip(why)
    done = subprocess.run([sys.executable, str(artifacts["te"] / "training" / "train_one_step.py")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "trained one step, loss" in done.stdout


def test_training_readme_lists_every_high_precision_layer(artifacts):
    readme = (artifacts["te"] / "training" / "README.md").read_text()
    config = json.loads((artifacts["te"] / "config.json").read_text())["fp8"]
    report = json.loads((artifacts["te"] / "fp8_report.json").read_text())["analysis"]["layers"]
    kept = [layer["path"] for layer in report if layer["path"] not in config["converted_modules"]]
    assert kept and all(f"`{path}`" in readme for path in kept)
