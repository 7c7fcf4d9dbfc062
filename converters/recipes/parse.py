"""Reading recipes from files: JSON objects and Accelerate ``config.yaml`` ``fp8_config`` blocks."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from converters.errors import RecipeError
from converters.recipes.base import brief
from converters.recipes.registry import TE_ALIASES, Recipe, recipe_from_dict
from converters.recipes.safe_yaml import YamlRefused, load_yaml

__all__ = ["recipe_from_accelerate_yaml", "load_recipe_file", "check_canonical_spelling"]


def recipe_from_accelerate_yaml(text: str) -> Recipe:
    """Read the ``fp8_config:`` block of an Accelerate ``config.yaml``.

    Requires ``mixed_precision: fp8`` and an explicit ``fp8_config.backend`` (Accelerate would otherwise
    pick a backend by what happens to be installed). Other top-level keys are Accelerate's business and
    are ignored. ``use_mxfp8_block_scaling: true`` gives TE's ``MXFP8BlockScaling`` with the block's
    ``fp8_format`` and ``margin``; the delayed-scaling keys ``accelerate config`` writes as well are dropped,
    as Accelerate drops them, and the recipe's warnings name them. The other recipes have no Accelerate
    spelling; write their canonical ``scaling`` in the block. Raises RecipeError; a field error names
    ``fp8_config.<field>``.
    """
    try:
        doc = load_yaml(text)
    except YamlRefused as exc:
        raise RecipeError(str(exc), field="recipe_file") from exc
    if not isinstance(doc, Mapping):
        raise RecipeError("An Accelerate config must be a YAML mapping.", field="recipe_file")
    mixed = doc.get("mixed_precision")
    if not isinstance(mixed, str) or mixed.strip().lower() != "fp8":
        raise RecipeError(
            f"The Accelerate config has mixed_precision: {brief(mixed)}; an FP8 recipe needs "
            "mixed_precision: fp8.",
            field="mixed_precision",
        )
    fp8_config = doc.get("fp8_config")
    if not isinstance(fp8_config, Mapping) or "backend" not in fp8_config:
        raise RecipeError(
            "The Accelerate config needs an fp8_config block with backend: TE or AO.",
            field="fp8_config.backend",
        )
    try:
        return recipe_from_dict(fp8_config)
    except RecipeError as exc:
        field_path = f"fp8_config.{exc.field}" if exc.field else "fp8_config"
        raise RecipeError(f"fp8_config: {exc.message}", field=field_path) from exc


def check_canonical_spelling(data: Mapping[str, Any], recipe: Recipe) -> None:
    """Refuse what only Accelerate writes in a recipe meant as JSON (a JSON recipe file, the API's ``recipe``).

    :func:`recipe_from_dict` reads Accelerate's spellings too (``TE``, ``amax_history_length``,
    ``use_mxfp8_block_scaling``, ``"(false, false, false)"``, enum values in any case), for the ``fp8_config`` of
    an Accelerate ``config.yaml``. A JSON recipe takes exactly what ``POST /v1/jobs`` takes, so a file that
    works with ``fp8forge convert --recipe`` works as the API's ``recipe`` too, and the other way round.

    Raises:
        RecipeError: naming the key, and what to write instead.
    """
    canonical = recipe.to_dict()
    keys = sorted(data, key=lambda key: key != "use_mxfp8_block_scaling")  # the key that explains the others
    for key in keys:
        value = data[key]
        if key == "use_mxfp8_block_scaling":
            instead = '"scaling": "mxfp8_block"' if value is True else "nothing (delayed scaling is the default)"
        elif key in TE_ALIASES:
            instead = f'"{TE_ALIASES[key]}": {json.dumps(canonical.get(TE_ALIASES[key]))}'
        elif key not in canonical:
            instead = f"one of {', '.join(canonical)}"
        elif value != canonical[key] or isinstance(value, str) is not isinstance(canonical[key], str):
            instead = f'"{key}": {json.dumps(canonical[key])}'
        else:
            continue
        raise RecipeError(f"{key} {brief(value)} is Accelerate's spelling, for an Accelerate config.yaml; a JSON "
                          f"recipe takes what the API's recipe object takes: write {instead}", field=str(key))


def load_recipe_file(path: str | Path) -> Recipe:
    """Load a recipe: ``.json`` -> :func:`recipe_from_dict` in the API's spelling (:func:`check_canonical_spelling`);
    ``.yaml``/``.yml`` -> Accelerate config, in Accelerate's.

    Raises RecipeError (with the path in the message) for a missing file, bad JSON/YAML or a bad recipe.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".yaml", ".yml"):
        raise RecipeError(f"{path}: a recipe file must end in .json, .yaml or .yml.", field="recipe_file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise RecipeError(f"{path}: cannot read recipe file: {exc}", field="recipe_file") from exc
    try:
        if suffix == ".json":
            try:
                data = json.loads(text)
            except (ValueError, RecursionError) as exc:  # ValueError: also an integer too long to convert
                raise RecipeError(f"Not valid JSON: {str(exc)[:200]}", field="recipe_file") from exc
            recipe = recipe_from_dict(data)
            check_canonical_spelling(data, recipe)
            return recipe
        return recipe_from_accelerate_yaml(text)
    except RecipeError as exc:
        raise RecipeError(f"{path}: {exc.message}", field=exc.field) from exc
