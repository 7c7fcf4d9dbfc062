"""The recipe's NVFP4 serving options, ``nvfp4_weight_scales``, ``nvfp4_weight_rounding`` and ``nvfp4_smoothing``:
every recipe class takes them, refuses a bad value naming the field, records each only when it is not the default (a
recipe recorded before the field existed reads back the same), and never hands them to the training library's own
recipe class."""

from __future__ import annotations

import json

import pytest

from converters.errors import RecipeError
from converters.recipes import (
    RECIPE_CLASSES,
    NVFP4Smoothing,
    NVFP4WeightRounding,
    NVFP4WeightScales,
    recipe_from_dict,
)

BASES = [{"backend": "te"}, {"backend": "te", "scaling": "current"}, {"backend": "te", "scaling": "mxfp8_block"},
         {"backend": "te", "scaling": "float8_block"}, {"backend": "te", "scaling": "nvfp4_block"}, {"backend": "ao"},
         {"backend": "ao", "scaling": "float8_training_op"}, {"backend": "ao", "scaling": "mxfp8_training_op"}]
#: option -> (its enum, its default, the other values)
OPTIONS = {"nvfp4_weight_scales": (NVFP4WeightScales, "rtn", ["mse", "four_over_six"]),
           "nvfp4_weight_rounding": (NVFP4WeightRounding, "nearest", ["gptq"]),
           "nvfp4_smoothing": (NVFP4Smoothing, "none", ["awq"])}
CHOICES = [(option, value) for option, (_, _, values) in OPTIONS.items() for value in values]


def test_the_table_covers_every_recipe_class():
    assert {type(recipe_from_dict(base)) for base in BASES} == set(RECIPE_CLASSES)


@pytest.mark.parametrize("base", BASES, ids=lambda base: "-".join(base.values()))
@pytest.mark.parametrize(("option", "value"), CHOICES)
def test_a_chosen_value_survives_to_dict_and_json(base, option, value):
    recipe = recipe_from_dict({**base, option: value})
    assert getattr(recipe, option) is OPTIONS[option][0](value)
    recorded = json.loads(json.dumps(recipe.to_dict()))
    assert recorded[option] == value
    assert recipe_from_dict(recorded) == recipe == type(recipe).from_dict(recorded)
    assert recipe != recipe_from_dict(base)


def test_the_options_are_recorded_together():
    chosen = {"nvfp4_weight_scales": "four_over_six", "nvfp4_weight_rounding": "gptq", "nvfp4_smoothing": "awq"}
    recipe = recipe_from_dict({"backend": "ao", **chosen})
    assert {key: recipe.to_dict()[key] for key in OPTIONS} == chosen


@pytest.mark.parametrize("base", BASES, ids=lambda base: "-".join(base.values()))
@pytest.mark.parametrize("option", OPTIONS)
def test_the_default_leaves_the_recorded_recipe_as_it_was(base, option):
    kind, default, _ = OPTIONS[option]
    recipe = recipe_from_dict(base)
    assert getattr(recipe, option) is kind(default)
    assert option not in recipe.to_dict()
    assert recipe_from_dict({**base, option: default}).to_dict() == recipe.to_dict()


@pytest.mark.parametrize("base", BASES, ids=lambda base: "-".join(base.values()))
@pytest.mark.parametrize(("option", "value"), CHOICES)
def test_the_training_library_never_receives_the_serving_option(base, option, value):
    recipe = recipe_from_dict({**base, option: value})
    for method in ("te_recipe_kwargs", "config_fields"):
        if hasattr(recipe, method):
            assert option not in json.dumps(getattr(recipe, method)(), default=str)


@pytest.mark.parametrize("value", ["gptq", "", 2, None, True])
def test_a_bad_method_is_refused_naming_the_field_and_the_choices(value):
    with pytest.raises(RecipeError, match="nvfp4_weight_scales must be one of rtn, mse, four_over_six") as info:
        recipe_from_dict({"backend": "ao", "nvfp4_weight_scales": value})
    assert info.value.field == "nvfp4_weight_scales"


@pytest.mark.parametrize("value", ["rtn", "GPTQ-seq", 1, None])
def test_a_bad_rounding_is_refused_naming_the_field_and_the_choices(value):
    with pytest.raises(RecipeError, match="nvfp4_weight_rounding must be one of nearest, gptq") as info:
        recipe_from_dict({"backend": "ao", "nvfp4_weight_rounding": value})
    assert info.value.field == "nvfp4_weight_rounding"


@pytest.mark.parametrize("value", ["AWQ-lite", "smoothquant", 0, None])
def test_a_bad_smoothing_is_refused_naming_the_field_and_the_choices(value):
    with pytest.raises(RecipeError, match="nvfp4_smoothing must be one of none, awq") as info:
        recipe_from_dict({"backend": "ao", "nvfp4_smoothing": value})
    assert info.value.field == "nvfp4_smoothing"


def test_the_method_names_are_the_nvfp4_exports_own():
    from converters.serving.nvfp4 import SCALE_SEARCHES

    assert tuple(member.value for member in NVFP4WeightScales) == SCALE_SEARCHES
