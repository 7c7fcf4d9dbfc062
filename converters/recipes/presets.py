"""Named recipes: the short names a comparison takes (CLI ``--recipes``, API ``compare_recipes``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from converters.errors import RecipeError
from converters.recipes.registry import Recipe, recipe_from_dict

__all__ = ["RECIPE_NAMES", "MAX_COMPARE_RECIPES", "parse_compare_recipe", "recipe_label"]

#: Short names a comparison takes (CLI ``--recipes``, API ``compare_recipes``), each a recipe at its defaults.
RECIPE_NAMES: dict[str, dict[str, str]] = {
    "te-delayed": {"backend": "te", "scaling": "delayed"},
    "te-current": {"backend": "te", "scaling": "current"},
    "te-mxfp8": {"backend": "te", "scaling": "mxfp8_block"},
    "te-float8-block": {"backend": "te", "scaling": "float8_block"},
    "te-nvfp4": {"backend": "te", "scaling": "nvfp4_block"},
    "ao-tensorwise": {"backend": "ao", "recipe_name": "tensorwise"},
    "ao-rowwise": {"backend": "ao", "recipe_name": "rowwise"},
    "ao-rowwise-gw-hp": {"backend": "ao", "recipe_name": "rowwise_with_gw_hp"},
    "ao-float8-op": {"backend": "ao", "scaling": "float8_training_op"},
    "ao-mxfp8-op": {"backend": "ao", "scaling": "mxfp8_training_op"},
}
MAX_COMPARE_RECIPES = 16


def _value(member: Any) -> str:
    return str(getattr(member, "value", member))


def parse_compare_recipe(item: Any, field: str) -> Recipe:
    """A comparison entry (a short name of :data:`RECIPE_NAMES` or a recipe object) as a recipe.

    Raises RecipeError naming ``field`` (``field.<key>`` for a bad recipe field).
    """
    if isinstance(item, str):
        if item not in RECIPE_NAMES:
            raise RecipeError(f"unknown recipe name {item!r}; known: {', '.join(RECIPE_NAMES)}", field=field)
        item = RECIPE_NAMES[item]
    if not isinstance(item, Mapping):
        raise RecipeError(f"{field} must be a recipe name or a recipe object", field=field)
    try:
        return recipe_from_dict(item)
    except RecipeError as exc:
        raise RecipeError(exc.message, field=f"{field}.{exc.field}" if exc.field else field) from exc


def recipe_label(recipe: Any) -> str:
    """The short name of a recipe's kind (``te-delayed``), whatever its other fields."""
    key = (_value(recipe.backend), _value(recipe.scaling))
    for name, data in RECIPE_NAMES.items():
        if (data["backend"], data.get("scaling", data.get("recipe_name"))) == key:
            return name
    return "-".join(key)
