"""The recipe's ``nvfp4_weight_scales``: every recipe class takes it, refuses a bad value naming the field, records it
only when it is not the default (a recipe recorded before the field existed reads back the same), and never hands it
to the training library's own recipe class."""

from __future__ import annotations

import json

import pytest

from converters.errors import RecipeError
from converters.recipes import RECIPE_CLASSES, NVFP4WeightScales, recipe_from_dict

BASES = [{"backend": "te"}, {"backend": "te", "scaling": "current"}, {"backend": "te", "scaling": "mxfp8_block"},
         {"backend": "te", "scaling": "float8_block"}, {"backend": "te", "scaling": "nvfp4_block"}, {"backend": "ao"},
         {"backend": "ao", "scaling": "float8_training_op"}, {"backend": "ao", "scaling": "mxfp8_training_op"}]


def test_the_table_covers_every_recipe_class():
    assert {type(recipe_from_dict(base)) for base in BASES} == set(RECIPE_CLASSES)


@pytest.mark.parametrize("base", BASES, ids=lambda base: "-".join(base.values()))
@pytest.mark.parametrize("value", ["mse", "four_over_six"])
def test_a_searched_method_survives_to_dict_and_json(base, value):
    recipe = recipe_from_dict({**base, "nvfp4_weight_scales": value})
    assert recipe.nvfp4_weight_scales is NVFP4WeightScales(value)
    recorded = json.loads(json.dumps(recipe.to_dict()))
    assert recorded["nvfp4_weight_scales"] == value
    assert recipe_from_dict(recorded) == recipe == type(recipe).from_dict(recorded)
    assert recipe != recipe_from_dict(base)


@pytest.mark.parametrize("base", BASES, ids=lambda base: "-".join(base.values()))
def test_the_default_is_rtn_and_leaves_the_recorded_recipe_as_it_was(base):
    recipe = recipe_from_dict(base)
    assert recipe.nvfp4_weight_scales is NVFP4WeightScales.RTN
    assert "nvfp4_weight_scales" not in recipe.to_dict()
    assert recipe_from_dict({**base, "nvfp4_weight_scales": "rtn"}).to_dict() == recipe.to_dict()


@pytest.mark.parametrize("base", BASES, ids=lambda base: "-".join(base.values()))
def test_the_training_library_never_receives_the_serving_option(base):
    recipe = recipe_from_dict({**base, "nvfp4_weight_scales": "mse"})
    for method in ("te_recipe_kwargs", "config_fields"):
        if hasattr(recipe, method):
            assert "nvfp4_weight_scales" not in json.dumps(getattr(recipe, method)(), default=str)


@pytest.mark.parametrize("value", ["gptq", "", 2, None, True])
def test_a_bad_method_is_refused_naming_the_field_and_the_choices(value):
    with pytest.raises(RecipeError, match="nvfp4_weight_scales must be one of rtn, mse, four_over_six") as info:
        recipe_from_dict({"backend": "ao", "nvfp4_weight_scales": value})
    assert info.value.field == "nvfp4_weight_scales"


def test_the_method_names_are_the_nvfp4_exports_own():
    from converters.serving.nvfp4 import SCALE_SEARCHES

    assert tuple(member.value for member in NVFP4WeightScales) == SCALE_SEARCHES
