"""torchao's ``quantize_`` training configs as recipes: ``Float8TrainingOpConfig`` and ``MXFP8TrainingOpConfig``.

torchao 0.18 (``torchao/prototype/moe_training/config.py``): ``quantize_(model, config)`` wraps each selected
weight in a training tensor (``Float8TrainingWeightWrapperTensor`` / ``MXFP8TrainingWeightWrapperTensor``) whose
``linear`` / ``_grouped_mm`` quantize the operands dynamically; the module stays an ``nn.Linear``. This is where
torchao moves training to, next to the ``Float8Linear`` module swap (``TorchAORecipe``).

* ``Float8TrainingOpConfig``: a Linear runs as ``Float8LinearConfig.from_recipe_name(float8_linear_recipe)``
  (``rowwise`` by default) through ``matmul_with_hp_or_float8_args``; ``float8_dtype`` (e4m3fn, e4m3fnuz on
  MI300) and ``out_dtype`` (bfloat16, grouped GEMMs only) are recorded as resolved, not chosen.
* ``MXFP8TrainingOpConfig``: E4M3 in blocks of 32 with E8M0 scales for input, weight and grad_output
  (``mxfp8_linear.py``, ``block_size = 32``); ``kernel_preference`` auto (Blackwell kernels) or emulated.

Both are stateless; the torchao configs they stand for are built by :mod:`converters.backends.torchao.config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from converters.recipes.base import (
    RECIPE_VERSION,
    AORecipeName,
    AOTrainingOp,
    Backend,
    MXKernelPreference,
    MXScaleCalculationMode,
    check_bool,
    coerce_enum,
)
from converters.recipes.registry import register_recipe, typed_from_dict
from converters.recipes.requirements import (
    ANY_DEVICE,
    FP8_RULE,
    TORCH_FP8_GPU,
    TORCHAO_MXFP8_GPU,
    TORCHAO_MXFP8_RULE,
    Hardware,
    ShapeRule,
    stateless_note,
)
from converters.recipes.serving_options import SERVING_KEY, ServingOptions

__all__ = ["AOFloat8TrainingOpRecipe", "AOMXFP8TrainingOpRecipe", "AO_LINEAR_CAST_FORMATS"]

#: Forward casts of a torchao Float8 linear recipe (tensorwise: one scale per tensor; rowwise: per row along K).
AO_LINEAR_CAST_FORMATS = {
    AORecipeName.TENSORWISE: {"input": "e4m3_tensor", "weight": "e4m3_tensor"},
    AORecipeName.ROWWISE: {"input": "e4m3_row", "weight": "e4m3_row"},
    AORecipeName.ROWWISE_WITH_GW_HP: {"input": "e4m3_row", "weight": "e4m3_row"},
}


class _AOTrainingOpRecipe:
    """What both training-op recipes share (a mixin; each subclass is the dataclass)."""

    config_name: ClassVar[str]
    scaling_value: ClassVar[AOTrainingOp]
    stateful: ClassVar[bool] = False
    training_op: ClassVar[bool] = True
    per_tensor_te: ClassVar[bool] = False

    def block_scaled(self) -> bool:
        """Whether a forward cast is block-scaled (MXFP8, NVFP4, FP8 blocks): no per-tensor scale applies."""
        return any("block" in spec for spec in self.cast_formats().values())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """The recipe ``data`` describes; RecipeError (field ``backend``) unless it is a ``cls``."""
        return typed_from_dict(cls, data)

    @property
    def backend(self) -> Backend:
        return Backend.AO

    @property
    def scaling(self) -> AOTrainingOp:
        return self.scaling_value

    @property
    def library_class(self) -> str:
        return f"torchao {self.config_name}"

    def state_note(self) -> str:
        return stateless_note(self.library_class)

    def warnings(self) -> list[str]:
        return []

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.metadata.get(SERVING_KEY)}

    def to_dict(self) -> dict[str, Any]:
        fields = {name: getattr(value, "value", value) for name, value in self._fields().items()}
        return {"version": RECIPE_VERSION, "backend": self.backend.value, "scaling": self.scaling.value, **fields,
                **self.serving_options()}



@register_recipe(Backend.AO, AOTrainingOp.FLOAT8)
@dataclass(frozen=True, kw_only=True)
class AOFloat8TrainingOpRecipe(_AOTrainingOpRecipe, ServingOptions):
    """torchao ``Float8TrainingOpConfig`` applied with ``quantize_`` to the eligible Linear weights."""

    config_name: ClassVar[str] = "Float8TrainingOpConfig"
    scaling_value: ClassVar[AOTrainingOp] = AOTrainingOp.FLOAT8

    float8_linear_recipe: AORecipeName = AORecipeName.ROWWISE
    pad_token_groups_for_grouped_mm: bool = False

    def __post_init__(self) -> None:
        self._check_serving_options()
        object.__setattr__(self, "float8_linear_recipe",
                           coerce_enum(self.float8_linear_recipe, AORecipeName, "float8_linear_recipe", upper=False))
        check_bool(self.pad_token_groups_for_grouped_mm, "pad_token_groups_for_grouped_mm")

    def config_fields(self) -> dict[str, Any]:
        """The resolved config as recorded in an artifact (dtypes as torch attribute names)."""
        return {"config": self.config_name, "float8_dtype": "float8_e4m3fn", "out_dtype": "bfloat16",
                "pad_token_groups_for_grouped_mm": self.pad_token_groups_for_grouped_mm,
                "float8_linear_recipe": self.float8_linear_recipe.value}


    def shape_rule(self) -> ShapeRule:
        return FP8_RULE

    def hardware(self) -> Hardware:
        return TORCH_FP8_GPU

    def cast_formats(self) -> dict[str, str]:
        return dict(AO_LINEAR_CAST_FORMATS[self.float8_linear_recipe])


@register_recipe(Backend.AO, AOTrainingOp.MXFP8)
@dataclass(frozen=True, kw_only=True)
class AOMXFP8TrainingOpRecipe(_AOTrainingOpRecipe, ServingOptions):
    """torchao ``MXFP8TrainingOpConfig`` applied with ``quantize_`` to the eligible Linear weights."""

    config_name: ClassVar[str] = "MXFP8TrainingOpConfig"
    scaling_value: ClassVar[AOTrainingOp] = AOTrainingOp.MXFP8

    kernel_preference: MXKernelPreference = MXKernelPreference.AUTO
    wgrad_with_hp: bool = False
    scale_calculation_mode: MXScaleCalculationMode = MXScaleCalculationMode.RCEIL
    pad_token_groups_for_grouped_mm: bool = False

    def __post_init__(self) -> None:
        self._check_serving_options()
        object.__setattr__(self, "kernel_preference",
                           coerce_enum(self.kernel_preference, MXKernelPreference, "kernel_preference", upper=False))
        object.__setattr__(self, "scale_calculation_mode", coerce_enum(
            self.scale_calculation_mode, MXScaleCalculationMode, "scale_calculation_mode", upper=False))
        for name in ("wgrad_with_hp", "pad_token_groups_for_grouped_mm"):
            check_bool(getattr(self, name), name)

    def config_fields(self) -> dict[str, Any]:
        return {"config": self.config_name, "kernel_preference": self.kernel_preference.value, "out_dtype": "bfloat16",
                "wgrad_with_hp": self.wgrad_with_hp, "scale_calculation_mode": self.scale_calculation_mode.value,
                "pad_token_groups_for_grouped_mm": self.pad_token_groups_for_grouped_mm}


    def shape_rule(self) -> ShapeRule:
        return TORCHAO_MXFP8_RULE

    def hardware(self) -> Hardware:
        return ANY_DEVICE if self.kernel_preference is MXKernelPreference.EMULATED else TORCHAO_MXFP8_GPU

    def cast_formats(self) -> dict[str, str]:
        return {"input": "mxfp8_e4m3_block32", "weight": "mxfp8_e4m3_block32"}
