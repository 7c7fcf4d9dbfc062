"""TransformerEngine runtime: is TE usable here, its autocast across versions, and our recipes as TE recipes.

Details, and the library sources they follow: README.md beside this file.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from contextlib import AbstractContextManager
from typing import Any

import torch

from converters.errors import BackendUnavailableError, RecipeError
from converters.recipes import Backend
from converters.recipes.requirements import hardware_unmet_here

__all__ = [
    "TE_INSTALL_HINT",
    "te_missing",
    "te_status",
    "require_te",
    "te_module",
    "te_autocast",
    "require_fp8_execution",
    "te_recipe_unsupported",
    "require_recipe_execution",
    "te_recipe_spec",
    "build_te_recipe",
    "te_align_size",
]


TE_INSTALL_HINT = (
    "Run this job on a GPU worker (CUDA; FP8 execution needs compute capability 8.9 or newer), or install "
    "TransformerEngine on a CUDA machine with a CUDA build of torch: "
    "pip install --no-build-isolation 'transformer_engine[pytorch]'"
)


# --- availability ---------------------------------------------------------------------------------

def te_missing() -> list[str]:
    """What keeps TE from running here (no CUDA device, package absent, import failure); empty when TE runs.

    Never raises. TE is imported only when CUDA is present (without CUDA its import fails while loading
    its libraries).
    """
    problems = []
    if not torch.cuda.is_available():
        problems.append(f"no CUDA device is visible to torch {torch.__version__} "
                        f"(torch.version.cuda={torch.version.cuda})")
    if importlib.util.find_spec("transformer_engine") is None:
        problems.append("the transformer_engine package is not installed")
    elif not problems:
        try:
            importlib.import_module("transformer_engine.pytorch")
        except Exception as exc:  # TE raises ImportError, OSError or RuntimeError for missing CUDA libraries
            problems.append(f"transformer_engine.pytorch failed to import ({type(exc).__name__}: {exc})")
    return problems


def te_status() -> tuple[bool, str]:
    """Whether TE can run here: a CUDA device is visible and ``transformer_engine.pytorch`` imports.

    Returns ``(True, "TransformerEngine <version> on <device>")`` or ``(False, message)`` where the
    message names what is missing (:func:`te_missing`) and how to fix it. Never raises.
    """
    problems = te_missing()
    if problems:
        return False, f"TransformerEngine backend unavailable: {'; '.join(problems)}. {TE_INSTALL_HINT}"
    te_root = importlib.import_module("transformer_engine")
    version = getattr(te_root, "__version__", "unknown version")
    return True, f"TransformerEngine {version} on {torch.cuda.get_device_name()}"


def require_te() -> None:
    """Raise BackendUnavailableError (message from :func:`te_status`) unless TE can run here."""
    ok, message = te_status()
    if not ok:
        raise BackendUnavailableError(message, field="backend")


def te_module() -> Any:
    """``transformer_engine.pytorch`` after :func:`require_te`."""
    require_te()
    return importlib.import_module("transformer_engine.pytorch")


def te_autocast(te: Any, *, enabled: bool, recipe: Any, calibrating: bool = False) -> AbstractContextManager:
    """``te.autocast`` (TE >= 2.10) or the older ``te.fp8_autocast`` (deprecated since 2.10)."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, calibrating=calibrating, recipe=recipe)
    return te.fp8_autocast(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe)


def require_fp8_execution(te: Any) -> None:
    """Raise BackendUnavailableError when this GPU cannot run FP8 GEMMs (TE asserts this on autocast)."""
    if hasattr(te, "is_fp8_available"):  # TE >= 2.10
        ok, reason = te.is_fp8_available(return_reason=True)
    else:
        ok, reason = importlib.import_module("transformer_engine.pytorch.fp8").check_fp8_support()
    if not ok:
        raise BackendUnavailableError(
            f"this GPU cannot run TransformerEngine FP8 ({reason}); run the job on an Ada, Hopper or newer "
            "GPU worker (compute capability 8.9+)", field="backend")


def te_recipe_unsupported(te: Any, recipe: Any) -> str | None:
    """TE's own answer to whether this GPU runs ``recipe`` (None: it does): ``te.is_<kind>_available`` (TE >= 2.10,
    ``pytorch/quantization.py``) or the older ``transformer_engine.pytorch.fp8.check_<kind>_support``."""
    new_name, old_name = _SUPPORT_CHECKS[recipe.te_class_name]
    if hasattr(te, new_name):
        ok, reason = getattr(te, new_name)(return_reason=True)
    else:
        check = getattr(importlib.import_module("transformer_engine.pytorch.fp8"), old_name, None)
        if check is None:
            return f"this TransformerEngine has no {recipe.te_class_name} support check ({old_name}): upgrade it"
        ok, reason = check()
    return None if ok else (reason or f"TransformerEngine reports {recipe.te_class_name} unsupported here")


def require_recipe_execution(te: Any, recipe: Any) -> None:
    """Raise BackendUnavailableError (field ``recipe``) when this GPU cannot run ``recipe``: by the compute
    capability the recipe needs (:mod:`converters.recipes.requirements`), then by TE's own check."""
    why = hardware_unmet_here(recipe)
    if why is None and (reason := te_recipe_unsupported(te, recipe)) is not None:
        why = f"TransformerEngine cannot run {recipe.te_class_name} on {torch.cuda.get_device_name()}: {reason}"
    if why is not None:
        raise BackendUnavailableError(f"{why}; run the job on a worker whose GPU has {recipe.hardware().needs}",
                                      field="recipe")


# --- recipes --------------------------------------------------------------------------------------

#: recipe class -> (TE >= 2.10 availability function in ``transformer_engine.pytorch``, older ``fp8.py`` check)
_SUPPORT_CHECKS = {
    "DelayedScaling": ("is_fp8_available", "check_fp8_support"),
    "Float8CurrentScaling": ("is_fp8_available", "check_fp8_support"),
    "MXFP8BlockScaling": ("is_mxfp8_available", "check_mxfp8_support"),
    "Float8BlockScaling": ("is_fp8_block_scaling_available", "check_fp8_block_scaling_support"),
    "NVFP4BlockScaling": ("is_nvfp4_available", "check_nvfp4_support"),
}
#: the TE release each recipe class first appears in (``common/recipe/__init__.py`` at the tags)
_TE_SINCE = {"DelayedScaling": "1.0", "Float8CurrentScaling": "2.2", "MXFP8BlockScaling": "2.0",
             "Float8BlockScaling": "2.3", "NVFP4BlockScaling": "2.8"}


def te_recipe_spec(recipe: Any) -> dict[str, Any]:
    """What :func:`build_te_recipe` hands TE for ``recipe``, as plain data (no TE needed):
    ``{"class": <TE recipe class>, "kwargs": {...}, "qparams": {attribute: QParams kwargs}}``.

    Every recorded field is passed, so TE's environment-variable defaults cannot change the recipe.
    Raises RecipeError for a recipe of another backend.
    """
    if getattr(recipe, "backend", None) is not Backend.TE:
        raise RecipeError(f"the TransformerEngine backend needs a te recipe, got {type(recipe).__name__}",
                          field="backend")
    return {"class": recipe.te_class_name, "kwargs": recipe.te_recipe_kwargs(), "qparams": recipe.te_qparams()}


def build_te_recipe(recipe: Any) -> Any:
    """The TE recipe object for one of our TE recipes: the class it names with its recorded fields (never TE's
    default recipe). Fields this TE does not have yet are left out while they hold their default, else refused.

    Raises BackendUnavailableError without CUDA/TE, or when this TE lacks the recipe class or a field set away from
    its default (upgrade TE); RecipeError for a recipe of another backend.
    """
    spec = te_recipe_spec(recipe)
    require_te()
    te_recipe = importlib.import_module("transformer_engine.common.recipe")
    name = spec["class"]
    cls = getattr(te_recipe, name, None)
    if cls is None:
        raise BackendUnavailableError(f"this TransformerEngine has no {name} recipe; upgrade it to {_TE_SINCE[name]} "
                                      "or newer: pip install --no-build-isolation -U 'transformer_engine[pytorch]'",
                                      field="backend")
    kwargs = _fields_this_te_has(cls, spec["kwargs"], type(recipe)().te_recipe_kwargs())
    if "fp8_format" in kwargs:
        kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    built = cls(**kwargs)
    for attribute, params in spec["qparams"].items():
        setattr(built, attribute, te_recipe.QParams(**params))
    return built


def _fields_this_te_has(cls: type, kwargs: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    names = {field.name for field in dataclasses.fields(cls)}
    for name, value in kwargs.items():
        if name not in names and value != defaults.get(name):
            raise BackendUnavailableError(f"this TransformerEngine's {cls.__name__} has no field {name} (the recipe "
                                          f"sets it to {value!r}): upgrade TransformerEngine, or convert with {name} "
                                          "at its default", field=f"recipe.{name}")
    return {name: value for name, value in kwargs.items() if name in names}


def te_align_size(recipe: Any) -> int:
    """Rows a grouped GEMM's per-expert token split is padded to for ``recipe``: TE's
    ``get_align_size_for_quantization`` (``pytorch/quantization.py``: 32 for MXFP8, 128 for NVFP4, 16 otherwise)."""
    return {"MXFP8BlockScaling": 32, "NVFP4BlockScaling": 128}.get(recipe.te_class_name, 16)
