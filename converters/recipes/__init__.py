"""FP8 recipes: what a conversion does, as frozen dataclasses, and their parsing. Pure data: no torch, no
torchao, no backend imports (the torchao configs are built in :mod:`converters.backends.torchao.config`).

Modules: ``base`` (enums, bounds, field checks), ``requirements`` (shape rules, GPUs), ``te`` / ``te_block``
(TransformerEngine recipes), ``torchao`` / ``torchao_training`` (torchao recipes), ``registry`` ((backend,
scaling) -> class, the ``Recipe`` union, ``recipe_from_dict``), ``parse`` (JSON and Accelerate YAML files),
``presets`` (the named recipes of ``--compare``), ``safe_yaml``, ``serving_options`` (what every recipe
carries for its job's serving exports). A new recipe is one class plus one registry line.
"""

from converters.recipes.base import (
    MAX_AMAX_HISTORY_LEN,
    MAX_INTERVAL,
    MAX_MARGIN,
    RECIPE_VERSION,
    AmaxComputeAlgo,
    AORecipeName,
    AOTrainingOp,
    Backend,
    Fp8Format,
    MXKernelPreference,
    MXScaleCalculationMode,
    NVFP4ErrMode,
    NVFP4Scope,
    NVFP4Smoothing,
    NVFP4WeightRounding,
    NVFP4WeightScales,
    TEScaling,
    check_bool,
)
from converters.recipes.parse import check_canonical_spelling, load_recipe_file, recipe_from_accelerate_yaml
from converters.recipes.registry import (
    RECIPES,
    Recipe,
    default_recipe,
    recipe_from_dict,
    register_recipe,
    typed_from_dict,
)
from converters.recipes.requirements import Hardware, ShapeRule, requirements
from converters.recipes.te import TECurrentScalingRecipe, TEDelayedScalingRecipe
from converters.recipes.te_block import TEFloat8BlockScalingRecipe, TEMXFP8BlockScalingRecipe, TENVFP4BlockScalingRecipe
from converters.recipes.torchao import TorchAORecipe
from converters.recipes.torchao_training import AOFloat8TrainingOpRecipe, AOMXFP8TrainingOpRecipe

__all__ = [
    "RECIPE_VERSION",
    "MAX_AMAX_HISTORY_LEN",
    "MAX_MARGIN",
    "MAX_INTERVAL",
    "Backend",
    "Fp8Format",
    "AmaxComputeAlgo",
    "TEScaling",
    "AORecipeName",
    "AOTrainingOp",
    "NVFP4Scope",
    "NVFP4ErrMode",
    "NVFP4WeightScales",
    "NVFP4WeightRounding",
    "NVFP4Smoothing",
    "MXKernelPreference",
    "MXScaleCalculationMode",
    "TEDelayedScalingRecipe",
    "TECurrentScalingRecipe",
    "TEMXFP8BlockScalingRecipe",
    "TEFloat8BlockScalingRecipe",
    "TENVFP4BlockScalingRecipe",
    "TorchAORecipe",
    "AOFloat8TrainingOpRecipe",
    "AOMXFP8TrainingOpRecipe",
    "RECIPES",
    "RECIPE_CLASSES",
    "register_recipe",
    "Recipe",
    "Hardware",
    "ShapeRule",
    "requirements",
    "check_bool",
    "recipe_from_dict",
    "recipe_from_accelerate_yaml",
    "load_recipe_file",
    "check_canonical_spelling",
    "default_recipe",
    "typed_from_dict",
]

#: Every recipe class, in the order the API and the UI list them.
RECIPE_CLASSES = (TEDelayedScalingRecipe, TECurrentScalingRecipe, TEMXFP8BlockScalingRecipe, TEFloat8BlockScalingRecipe,
                  TENVFP4BlockScalingRecipe, TorchAORecipe, AOFloat8TrainingOpRecipe, AOMXFP8TrainingOpRecipe)
