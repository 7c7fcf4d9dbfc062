"""The API's recipe request models and the recipe dataclasses cannot drift: the same fields, the same defaults,
the same integer bounds, and an API model for every recipe class."""

from __future__ import annotations

import dataclasses
import typing

import annotated_types
import pytest

from converters.errors import RecipeError
from converters.recipes import (
    RECIPE_CLASSES,
    AOFloat8TrainingOpRecipe,
    AOMXFP8TrainingOpRecipe,
    TECurrentScalingRecipe,
    TEDelayedScalingRecipe,
    TEFloat8BlockScalingRecipe,
    TEMXFP8BlockScalingRecipe,
    TENVFP4BlockScalingRecipe,
    TorchAORecipe,
)
from service.api import recipe_schemas as api

PAIRS = {
    TEDelayedScalingRecipe: api.TEDelayedRecipeCreate,
    TECurrentScalingRecipe: api.TECurrentRecipeCreate,
    TEMXFP8BlockScalingRecipe: api.TEMXFP8RecipeCreate,
    TEFloat8BlockScalingRecipe: api.TEFloat8BlockRecipeCreate,
    TENVFP4BlockScalingRecipe: api.TENVFP4RecipeCreate,
    TorchAORecipe: api.TorchAORecipeCreate,
    AOFloat8TrainingOpRecipe: api.AOFloat8TrainingOpRecipeCreate,
    AOMXFP8TrainingOpRecipe: api.AOMXFP8TrainingOpRecipeCreate,
}
ENVELOPE = {"version", "backend", "scaling"}
#: Fields set so that one bounded field can take each of its values alone (two 128x128-block operands are refused).
NEUTRAL = {TEFloat8BlockScalingRecipe: {"x_block_scaling_dim": 1, "w_block_scaling_dim": 1,
                                        "grad_block_scaling_dim": 1}}


def _recipe_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.metadata.get("recipe_key", True)}


def _bounds(model: type, name: str) -> tuple[int | None, int | None]:
    """The ``ge``/``le`` of an integer field (``json_int``), also inside ``X | None``."""
    low = high = None
    annotation = model.model_fields[name].annotation
    candidates = [model.model_fields[name], *typing.get_args(annotation)]
    for candidate in candidates:
        for item in getattr(candidate, "metadata", None) or getattr(candidate, "__metadata__", ()):
            for part in getattr(item, "metadata", [item]):
                if isinstance(part, annotated_types.Ge):
                    low = part.ge
                if isinstance(part, annotated_types.Le):
                    high = part.le
    return low, high


def test_every_recipe_class_has_an_api_model():
    assert set(PAIRS) == set(RECIPE_CLASSES)


@pytest.mark.parametrize(("recipe", "model"), PAIRS.items(), ids=lambda value: getattr(value, "__name__", ""))
def test_the_api_model_has_exactly_the_recipe_fields_and_defaults(recipe, model):
    fields = _recipe_fields(recipe)
    assert set(model.model_fields) - ENVELOPE == set(fields)
    default = recipe()
    for name in fields:
        api_default = model.model_fields[name].get_default(call_default_factory=True)
        ours = getattr(default, name)
        assert api_default == ours or (api_default is None and ours is None) or list(ours or []) == api_default, name


@pytest.mark.parametrize(("recipe", "model"), PAIRS.items(), ids=lambda value: getattr(value, "__name__", ""))
def test_the_api_model_bounds_are_the_recipe_bounds(recipe, model):
    checked = 0
    for name in _recipe_fields(recipe):
        low, high = _bounds(model, name)
        if low is None and high is None:
            continue
        checked += 1
        for inside in (low, high):
            recipe(**{**NEUTRAL.get(recipe, {}), name: inside})
        for outside in (low - 1, high + 1):
            with pytest.raises(RecipeError):
                recipe(**{**NEUTRAL.get(recipe, {}), name: outside})
    if recipe in (TEDelayedScalingRecipe, TEMXFP8BlockScalingRecipe, TEFloat8BlockScalingRecipe):
        assert checked  # the walk sees the bounds at all
