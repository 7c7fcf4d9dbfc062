"""The recipes the new-job form offers beyond TE delayed/current and torchao ``Float8Linear``, read from the API.

Each variant's options (their names, kinds, defaults, choices, bounds and descriptions) come from the JSON schema
of the request model the API validates that recipe with, so a field the API adds or bounds it changes reaches the
form without an edit here. The three older recipes keep their hand-written fields in the template. An option every
recipe takes (``nvfp4_weight_scales``) is one control of the form for all of them, not one per recipe.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from service.api.recipe_schemas import (
    AOFloat8TrainingOpRecipeCreate,
    AOMXFP8TrainingOpRecipeCreate,
    TECurrentRecipeCreate,
    TEDelayedRecipeCreate,
    TEFloat8BlockRecipeCreate,
    TEMXFP8RecipeCreate,
    TENVFP4RecipeCreate,
    TorchAORecipeCreate,
)

__all__ = ["recipe_variants", "shared_options"]

_MODELS: tuple[type[BaseModel], ...] = (
    TEMXFP8RecipeCreate, TEFloat8BlockRecipeCreate, TENVFP4RecipeCreate,
    AOFloat8TrainingOpRecipeCreate, AOMXFP8TrainingOpRecipeCreate,
)
#: the recipes whose fields the template writes by hand
_HAND_WRITTEN: tuple[type[BaseModel], ...] = (TEDelayedRecipeCreate, TECurrentRecipeCreate, TorchAORecipeCreate)
_FIXED = ("version", "backend", "scaling")  # what picks the variant rather than tunes it
#: the options every recipe model has (its shared base's), offered once for whichever recipe is chosen
_SHARED = tuple(name for name in TEDelayedRecipeCreate.model_fields if name not in _FIXED
                and all(name in model.model_fields for model in _MODELS + _HAND_WRITTEN))


def recipe_variants() -> list[dict[str, Any]]:
    """One entry per variant: ``backend``, ``scaling``, ``summary`` (the model's first line) and ``options``.

    An option is ``{"name", "kind", "default", "hint"}`` with ``kind`` one of ``select`` (plus ``choices``),
    ``checkbox`` or ``number`` (plus ``min`` and ``max``).
    """
    return [_variant(model) for model in _MODELS]


def shared_options() -> list[dict[str, Any]]:
    """The options every recipe takes, as :func:`recipe_variants` describes an option (read from one recipe's schema:
    they are its shared base's)."""
    schema = TEDelayedRecipeCreate.model_json_schema()
    return [_option(name, schema["properties"][name], schema.get("$defs", {})) for name in _SHARED]


def _variant(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema()
    definitions = schema.get("$defs", {})
    props = schema["properties"]
    options = [_option(name, prop, definitions) for name, prop in props.items()
               if name not in _FIXED and name not in _SHARED]
    return {"backend": props["backend"]["const"], "scaling": props["scaling"]["const"],
            "summary": _plain((model.__doc__ or "").strip().splitlines()[0]), "options": options}


def _plain(text: str) -> str:
    return text.replace("``", "")  # the docstrings' code marks, which the page shows as they are


def _option(name: str, prop: dict[str, Any], definitions: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in prop:
        prop = {**definitions[prop["$ref"].rsplit("/", 1)[-1]], **prop}
    option = {"name": name, "default": prop.get("default"), "hint": _plain(prop.get("description", ""))}
    if "enum" in prop:
        return {**option, "kind": "select", "choices": list(prop["enum"])}
    if prop.get("type") == "boolean":
        return {**option, "kind": "checkbox"}
    if prop.get("type") == "integer":
        return {**option, "kind": "number", "min": prop["minimum"], "max": prop["maximum"]}
    raise TypeError(f"{name}: the form has no control for the schema {prop!r}")  # a new kind of field: add one
