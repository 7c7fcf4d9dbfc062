"""TransformerEngine runtime: is TE usable here, its autocast across versions, and our recipes as TE recipes.

TransformerEngine (TE) needs CUDA; it cannot be installed or imported on a machine without it. This module
therefore imports only torch and our own modules at module level: every function that needs TE calls
:func:`require_te` first (so a CPU machine gets a :class:`BackendUnavailableError` before any work) and
imports TE inside the function.

Written against TE 2.x source (checked at the 2.20 development head and tags v2.0, v2.5, v2.8, v2.10,
v2.14, v2.18). The module swap (``te_swap``), the scaling state (``te_state``), the whole-model check step
(``te_check_step``) and the per-layer check (``te_layer_check``) live in their own files. The TE attributes
used, all in ``transformer_engine/pytorch``:

* ``module/base.py`` ``TransformerEngineBaseModule``: ``fp8_meta["scaling_fwd"]`` /
  ``fp8_meta["scaling_bwd"]`` hold a ``DelayedScalingRecipeState`` (``quantization.py``; ``fp8.py``
  before 2.10) whose ``.scale`` is fp32 ``[num_gemms*3]`` (fwd) / ``[num_gemms*2]`` (bwd) and
  ``.amax_history`` fp32 ``[amax_history_len, n]``. Its ``Float8Quantizer`` objects hold *views* of those
  tensors, and ``FP8GlobalStateManager`` keeps references to them in its reduction buffers, so state is
  written with in-place ``copy_`` (as TE's own ``set_extra_state`` does), never by rebinding.
* ``init_fp8_metadata(num_gemms=1)`` run inside ``autocast(enabled=False, calibrating=True, recipe=r)``
  sets ``fp8_meta["recipe"] = r``, ``num_gemms``, ``fp8_max_fwd/bwd`` and allocates the state through
  ``init_fp8_meta_tensors`` -> ``set_meta_tensor``; with ``enabled=False`` no FP8-capable GPU is needed
  and the autocast exit runs no amax/scale update. If the module already holds delayed-scaling state,
  ``set_meta_tensor`` keeps it and only resizes the history (``adjust_amax_history_length``).
* ``get_extra_state()``: TE's pickled ``_extra_state`` (``{"recipe", "scale_fwd", "amax_history_fwd",
  "scale_bwd", "amax_history_bwd", "extra_fp8_variables"}``), written only when
  ``fp8_meta["fp8_checkpoint"]`` (or ``module.fp8`` / ``module.fp8_calibration``) is true.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from contextlib import AbstractContextManager
from typing import Any

import torch

from converters.errors import BackendUnavailableError, RecipeError
from converters.recipes import TECurrentScalingRecipe, TEDelayedScalingRecipe

__all__ = [
    "TE_INSTALL_HINT",
    "te_missing",
    "te_status",
    "require_te",
    "te_module",
    "te_autocast",
    "require_fp8_execution",
    "build_te_recipe",
]

logger = logging.getLogger(__name__)

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


# --- recipes --------------------------------------------------------------------------------------

def build_te_recipe(recipe: TEDelayedScalingRecipe | TECurrentScalingRecipe) -> Any:
    """TE's ``DelayedScaling`` or ``Float8CurrentScaling`` for one of our TE recipes (fields map 1:1).

    Raises BackendUnavailableError without CUDA/TE (or, for current scaling, with TE < 2.2), RecipeError for a
    recipe of another backend.
    """
    if not isinstance(recipe, (TEDelayedScalingRecipe, TECurrentScalingRecipe)):
        raise RecipeError(f"the TransformerEngine backend needs a te recipe, got {type(recipe).__name__}",
                          field="backend")
    require_te()
    te_recipe = importlib.import_module("transformer_engine.common.recipe")
    kwargs = recipe.te_recipe_kwargs()
    kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    name = "DelayedScaling" if isinstance(recipe, TEDelayedScalingRecipe) else "Float8CurrentScaling"
    if not hasattr(te_recipe, name):  # Float8CurrentScaling arrived in TE 2.2
        raise BackendUnavailableError(f"this TransformerEngine has no {name} recipe; upgrade it to 2.2 or newer: "
                                      "pip install --no-build-isolation -U 'transformer_engine[pytorch]'",
                                      field="backend")
    return getattr(te_recipe, name)(**kwargs)
