"""A conversion that would convert nothing because of its recipe's shape rule names the recipes whose rules this
model's dims meet (how many layers each would convert), never the recipe in use or one with the same rule; and
says so when no recipe fits at all (issue #35, item 5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from converters import api
from converters.errors import RequestError
from converters.recipes.presets import RECIPE_NAMES


def _save_llama(directory: Path, hidden: int, intermediate: int, heads: int = 4, kv_heads: int = 2) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=256)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nothing-eligible")
    _save_llama(root / "dims-64", hidden=64, intermediate=128)  # % 32 everywhere (k_proj 32 wide), never % 128
    _save_llama(root / "dims-48", hidden=48, intermediate=80, heads=3, kv_heads=1)  # % 16 everywhere, never % 32
    _save_llama(root / "dims-40", hidden=40, intermediate=72)  # % 8 everywhere, never % 16
    return root


def _refusal(models: Path, model: str, recipe_name: str) -> str:
    with pytest.raises(RequestError) as caught:
        api.convert(str(models / model), models / f"out-{model}-{recipe_name}", recipe=RECIPE_NAMES[recipe_name],
                    sources=api.local_sources(models, offline=True))
    assert caught.value.field == "recipe"
    assert not (models / f"out-{model}-{recipe_name}").exists()
    return caught.value.message


def _named(message: str) -> set[str]:
    choices = message.split("dims meet: ", 1)[1].split(" (a name stands", 1)[0]
    return {name.strip() for part in choices.split(";") for name in part.split(" would convert")[0].split(",")}


def test_a_block_recipe_that_fits_no_layer_names_the_recipes_that_would(models):
    message = _refusal(models, "dims-64", "te-float8-block")
    assert "both Linear dims divisible by 128, which no layer meets" in message
    # every recipe whose rule is % 16 or % 32 converts all 13 layers the 128 rule alone left out; the first and
    # last Linear stay out whatever the recipe (skip_first_last), so they are not counted
    assert _named(message) == set(RECIPE_NAMES) - {"te-float8-block", "te-nvfp4"}
    assert "would convert 13 layers" in message
    assert json.dumps(RECIPE_NAMES["te-delayed"]) in message  # how a name is written as a recipe


def test_an_mxfp8_recipe_is_told_of_the_per_tensor_recipes_only(models):
    message = _refusal(models, "dims-48", "te-mxfp8")
    assert "both Linear dims divisible by 32, which no layer meets" in message
    # ao-mxfp8-op has the same % 32 rule (its own statement of it) and finds the same nothing
    assert _named(message) == {"te-delayed", "te-current", "ao-tensorwise", "ao-rowwise", "ao-rowwise-gw-hp",
                               "ao-float8-op"}


def test_no_recipe_fits_says_so_and_never_suggests_the_recipe_in_use(models):
    message = _refusal(models, "dims-40", "te-delayed")
    assert "both Linear dims divisible by 16" in message
    assert "no recipe fp8forge knows has a rule this model's dims meet" in message
    assert "te-delayed" not in message and "TE delayed" not in message
