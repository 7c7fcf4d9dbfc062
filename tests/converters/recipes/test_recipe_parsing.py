"""Recipes: defaults, validation, JSON / Accelerate-YAML parsing, and the real torchao config."""

from __future__ import annotations

import json

import pytest

from converters.backends.torchao.config import float8_config_dict, float8_linear_config, float8_linear_config_from_dict
from converters.errors import RecipeError
from converters.recipes import (
    AmaxComputeAlgo,
    AORecipeName,
    Backend,
    Fp8Format,
    TECurrentScalingRecipe,
    TEDelayedScalingRecipe,
    TorchAORecipe,
    default_recipe,
    load_recipe_file,
    recipe_from_accelerate_yaml,
    recipe_from_dict,
)

# The two config.yaml examples below are copied verbatim from the seed document
# shared/seeds/000_ce1f3964fdb40b00.txt (Accelerate's "low precision training" guide, Spanish edition);
# they are inlined so the test does not depend on where shared/ is checked out.
SEED_TE_YAML = """\
mixed_precision: fp8
fp8_config:
    amax_compute_algo: max
    amax_history_len: 1024
    backend: TE
    fp8_format: HYBRID
    interval: 1
    margin: 0
    override_linear_precision: (false, false, false)
    use_autocast_during_eval: false
"""

SEED_AO_YAML = """\
mixed_precision: fp8
fsdp_config:
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: false
  fsdp_version: 2
fp8_config:
  backend: AO
  pad_inner_dim: true
  enable_fsdp_float8_all_gather: true
dynamo_config:
  dynamo_backend: INDUCTOR
  dynamo_use_regional_compilation: true
"""


def test_te_defaults_are_transformer_engine_defaults():
    recipe = TEDelayedScalingRecipe()
    assert recipe.fp8_format is Fp8Format.HYBRID
    assert recipe.amax_history_len == 1024
    assert recipe.amax_compute_algo is AmaxComputeAlgo.MAX  # TE's default; Accelerate's is most_recent
    assert recipe.margin == 0
    assert (recipe.interval, recipe.override_linear_precision, recipe.use_autocast_during_eval) == (
        None,
        None,
        False,
    )
    assert recipe.backend == "te" and recipe.scaling == "delayed"
    assert recipe.warnings() == []


def test_ao_defaults_are_torchao_defaults():
    recipe = TorchAORecipe()
    assert recipe.recipe_name is AORecipeName.TENSORWISE
    assert not (recipe.pad_inner_dim or recipe.enable_fsdp_float8_all_gather or recipe.emulate)
    assert recipe.backend == "ao" and recipe.scaling == "tensorwise"


def test_default_recipe():
    assert default_recipe("TE") == TEDelayedScalingRecipe()
    assert default_recipe("ao") == TorchAORecipe()
    with pytest.raises(RecipeError) as info:
        default_recipe("msamp")
    assert info.value.field == "backend"


def test_seed_te_yaml_parses_and_warns_about_removed_keys():
    recipe = recipe_from_accelerate_yaml(SEED_TE_YAML)
    assert recipe == TEDelayedScalingRecipe(
        fp8_format="HYBRID",
        amax_history_len=1024,
        amax_compute_algo="max",
        margin=0,
        interval=1,
        override_linear_precision=(False, False, False),
        use_autocast_during_eval=False,
    )
    warnings = recipe.warnings()
    assert len(warnings) == 2
    assert any("interval" in w and "no effect" in w for w in warnings)
    assert any("override_linear_precision" in w and "removed from TransformerEngine" in w for w in warnings)


def test_seed_ao_yaml_parses():
    recipe = recipe_from_accelerate_yaml(SEED_AO_YAML)
    assert recipe == TorchAORecipe(pad_inner_dim=True, enable_fsdp_float8_all_gather=True)


def test_accelerate_config_command_spellings_are_accepted():
    # `accelerate config` writes amax_history_length / amax_compute_algorithm into fp8_config.
    text = (
        "mixed_precision: fp8\nfp8_config:\n  backend: te\n"
        "  amax_history_length: 16\n  amax_compute_algorithm: most_recent\n"
    )
    recipe = recipe_from_accelerate_yaml(text)
    assert recipe.amax_history_len == 16 and recipe.amax_compute_algo is AmaxComputeAlgo.MOST_RECENT


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("mixed_precision: bf16\nfp8_config:\n  backend: TE\n", "mixed_precision"),
        ("fp8_config:\n  backend: TE\n", "mixed_precision"),
        ("mixed_precision: fp8\n", "fp8_config.backend"),
        ("mixed_precision: fp8\nfp8_config:\n  backend: TE\n  margin: -1\n", "fp8_config.margin"),
        ("mixed_precision: fp8\nfp8_config:\n  backend: TE\n  warmup: 3\n", "fp8_config.warmup"),
        ("mixed_precision: fp8\nfp8_config: [1, 2\n", "recipe_file"),
        ("- just\n- a list\n", "recipe_file"),
    ],
)
def test_bad_accelerate_yaml(text, field):
    with pytest.raises(RecipeError) as info:
        recipe_from_accelerate_yaml(text)
    assert info.value.field == field


@pytest.mark.parametrize(
    "recipe",
    [
        TEDelayedScalingRecipe(),
        TEDelayedScalingRecipe(
            fp8_format="e4m3",
            amax_history_len=8,
            amax_compute_algo="most_recent",
            margin=2,
            interval=4,
            override_linear_precision=(True, False, True),
            use_autocast_during_eval=True,
        ),
        TECurrentScalingRecipe(fp8_format="E4M3"),
        TorchAORecipe(recipe_name="rowwise_with_gw_hp", pad_inner_dim=True, emulate=True),
    ],
)
def test_json_round_trip(recipe):
    data = json.loads(json.dumps(recipe.to_dict()))
    assert data["version"] == 1 and data["backend"] == recipe.backend.value
    assert recipe_from_dict(data) == recipe
    assert type(recipe).from_dict(data) == recipe


def test_te_to_dict_names_the_scaling():
    assert TEDelayedScalingRecipe().to_dict()["scaling"] == "delayed"
    assert TECurrentScalingRecipe().to_dict()["scaling"] == "current"


@pytest.mark.parametrize("backend", ["te", "TE", "Te", " te "])
def test_backend_is_case_insensitive(backend):
    assert recipe_from_dict({"backend": backend}) == TEDelayedScalingRecipe()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({"backend": "AO"}, TorchAORecipe()),
        ({"backend": "te", "scaling": "CURRENT"}, TECurrentScalingRecipe()),
        ({"backend": "te", "fp8_format": "e4m3"}, TEDelayedScalingRecipe(fp8_format=Fp8Format.E4M3)),
        (
            {"backend": "te", "override_linear_precision": [False, True, False]},
            TEDelayedScalingRecipe(override_linear_precision=(False, True, False)),
        ),
        (
            {"backend": "te", "override_linear_precision": "true,false,false"},
            TEDelayedScalingRecipe(override_linear_precision=(True, False, False)),
        ),
        ({"backend": "te", "use_mxfp8_block_scaling": False}, TEDelayedScalingRecipe()),
    ],
)
def test_recipe_from_dict_accepts(data, expected):
    assert recipe_from_dict(data) == expected


@pytest.mark.parametrize(
    ("data", "field", "mentions"),
    [
        ({}, "backend", "te or ao"),
        ({"backend": "msamp"}, "backend", "MS-AMP"),
        ({"backend": "cuda"}, "backend", "te, ao"),
        ({"backend": 3}, "backend", "te, ao"),
        ({"backend": "te", "version": 2}, "version", "version 1"),
        ({"backend": "te", "scaling": "block"}, "scaling", "delayed, current"),
        ({"backend": "te", "fp8_format": "E5M2"}, "fp8_format", "HYBRID, E4M3"),
        ({"backend": "te", "fp8_format": "fp8"}, "fp8_format", "HYBRID, E4M3"),
        ({"backend": "te", "amax_history_len": 0}, "amax_history_len", ">= 1"),
        ({"backend": "te", "amax_history_len": "16"}, "amax_history_len", ">= 1"),
        ({"backend": "te", "amax_history_len": True}, "amax_history_len", ">= 1"),
        ({"backend": "te", "amax_compute_algo": "mean"}, "amax_compute_algo", "max, most_recent"),
        ({"backend": "te", "margin": -1}, "margin", ">= 0"),
        ({"backend": "te", "margin": 1.5}, "margin", ">= 0"),
        ({"backend": "te", "interval": 0}, "interval", ">= 1"),
        ({"backend": "te", "override_linear_precision": [True, False]}, "override_linear_precision", "three"),
        ({"backend": "te", "override_linear_precision": "(yes, no)"}, "override_linear_precision", "three"),
        ({"backend": "te", "use_autocast_during_eval": "no"}, "use_autocast_during_eval", "true or false"),
        # use_mxfp8_block_scaling: true is MXFP8BlockScaling (test_block_and_training_op_recipes.py); with another
        # scaling, refused
        ({"backend": "te", "scaling": "current", "use_mxfp8_block_scaling": True}, "use_mxfp8_block_scaling",
         "MXFP8"),
        ({"backend": "te", "amax_history_len": 8, "amax_history_length": 8}, "amax_history_length", "either"),
        ({"backend": "te", "recipe_name": "rowwise"}, "recipe_name", "allowed keys"),
        ({"backend": "te", "scaling": "current", "margin": 1}, "margin", "allowed keys: version, backend"),
        ({"backend": "ao", "recipe_name": "blockwise"}, "recipe_name", "tensorwise, rowwise"),
        ({"backend": "ao", "emulate": 1}, "emulate", "true or false"),
        ({"backend": "ao", "use_fsdp2": True}, "use_fsdp2", "pad_inner_dim"),
        ({"backend": "ao", "fp8_format": "HYBRID"}, "fp8_format", "allowed keys"),
        (
            {"backend": "ao", "recipe_name": "rowwise", "enable_fsdp_float8_all_gather": True},
            "enable_fsdp_float8_all_gather",
            "tensorwise",
        ),
    ],
)
def test_recipe_from_dict_rejects_naming_the_field(data, field, mentions):
    with pytest.raises(RecipeError) as info:
        recipe_from_dict(data)
    assert info.value.field == field
    assert field in info.value.message or field in ("backend", "version")
    assert mentions in info.value.message


def test_recipe_from_dict_needs_a_mapping():
    with pytest.raises(RecipeError):
        recipe_from_dict(["backend", "te"])


def test_from_dict_of_the_wrong_class():
    with pytest.raises(RecipeError) as info:
        TorchAORecipe.from_dict({"backend": "te"})
    assert info.value.field == "backend"


def test_recipes_are_frozen_and_keyword_only():
    recipe = TEDelayedScalingRecipe()
    with pytest.raises(AttributeError):
        recipe.margin = 3
    with pytest.raises(TypeError):
        TEDelayedScalingRecipe("HYBRID")


def test_te_recipe_kwargs():
    assert TEDelayedScalingRecipe(margin=1).te_recipe_kwargs() == {
        "fp8_format": "HYBRID",
        "amax_history_len": 1024,
        "amax_compute_algo": "max",
        "margin": 1,
    }


# --- files ----------------------------------------------------------------------------------------


def test_load_recipe_file_json_and_yaml(tmp_path):
    json_path = tmp_path / "recipe.json"
    json_path.write_text(json.dumps({"backend": "ao", "recipe_name": "rowwise"}))
    assert load_recipe_file(json_path) == TorchAORecipe(recipe_name="rowwise")
    for name in ("config.yaml", "config.YML"):
        yaml_path = tmp_path / name
        yaml_path.write_text(SEED_TE_YAML)
        assert load_recipe_file(yaml_path).interval == 1


@pytest.mark.parametrize(
    ("name", "content", "field"),
    [
        ("bad.json", "{not json", "recipe_file"),
        ("bad.yaml", "mixed_precision: fp8\nfp8_config: {backend: TE", "recipe_file"),
        ("recipe.toml", "backend = 'te'", "recipe_file"),
        ("missing.json", None, "recipe_file"),
        ("unknown.json", '{"backend": "te", "colour": "blue"}', "colour"),
    ],
)
def test_load_recipe_file_errors_name_the_path(tmp_path, name, content, field):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(RecipeError) as info:
        load_recipe_file(path)
    assert str(path) in info.value.message
    assert info.value.field == field


# --- torchao (real library) -----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_torchao_config_is_built_from_the_recipe_name(name):
    from torchao.float8 import Float8LinearConfig

    recipe = TorchAORecipe(recipe_name=name, pad_inner_dim=True, emulate=True)
    config = float8_linear_config(recipe)
    base = Float8LinearConfig.from_recipe_name(name)
    assert config.pad_inner_dim and config.emulate and not config.enable_fsdp_float8_all_gather
    assert config.cast_config_weight == base.cast_config_weight
    assert config.round_scales_to_power_of_2 == base.round_scales_to_power_of_2


@pytest.mark.parametrize("name", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_float8_config_dict_replays_exactly(name):
    recipe = TorchAORecipe(recipe_name=name, emulate=True, enable_fsdp_float8_all_gather=name == "tensorwise")
    data = json.loads(json.dumps(float8_config_dict(recipe)))
    assert data["cast_config_grad_output"]["target_dtype"] in ("float8_e5m2", "float8_e4m3fn")
    assert data["cast_config_input"]["scaling_granularity"] in ("tensorwise", "axiswise")
    assert float8_linear_config_from_dict(data) == float8_linear_config(recipe)


def test_float8_config_dict_rejects_unknown_and_bad_values():
    good = float8_config_dict(TorchAORecipe())
    with pytest.raises(RecipeError) as info:
        float8_linear_config_from_dict(good | {"delayed": True})
    assert info.value.field == "delayed"
    bad_dtype = good | {"cast_config_input": good["cast_config_input"] | {"target_dtype": "float32"}}
    with pytest.raises(RecipeError) as info:
        float8_linear_config_from_dict(bad_dtype)
    assert info.value.field == "cast_config_input"
    # torchao's own asserts surface as RecipeError, not AssertionError
    disabled = good | {"cast_config_input": good["cast_config_input"] | {"scaling_type": "disabled"}}
    with pytest.raises(RecipeError):
        float8_linear_config_from_dict(disabled)


def test_backend_enum_values():
    assert [b.value for b in Backend] == ["te", "ao"]
