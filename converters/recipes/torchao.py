"""torchao's ``Float8Linear`` recipe (``Float8LinearConfig.from_recipe_name`` plus per-linear options).

Pure data: the torchao config it stands for is built by :mod:`converters.backends.torchao.config`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from converters.errors import RecipeError
from converters.recipes.base import RECIPE_VERSION, AORecipeName, Backend, check_bool, coerce_enum
from converters.recipes.registry import register_recipe, typed_from_dict
from converters.recipes.requirements import ANY_DEVICE, FP8_RULE, TORCH_FP8_GPU, Hardware, ShapeRule, stateless_note
from converters.recipes.serving_options import ServingOptions
from converters.recipes.torchao_training import AO_LINEAR_CAST_FORMATS

__all__ = ["TorchAORecipe"]


@register_recipe(Backend.AO, None)
@dataclass(frozen=True, kw_only=True)
class TorchAORecipe(ServingOptions):
    """torchao ``Float8LinearConfig.from_recipe_name(recipe_name)`` plus per-linear options."""

    stateful: ClassVar[bool] = False
    training_op: ClassVar[bool] = False
    per_tensor_te: ClassVar[bool] = False

    recipe_name: AORecipeName = AORecipeName.TENSORWISE
    pad_inner_dim: bool = False
    enable_fsdp_float8_all_gather: bool = False
    emulate: bool = False

    def __post_init__(self) -> None:
        self._check_serving_options()
        object.__setattr__(
            self, "recipe_name", coerce_enum(self.recipe_name, AORecipeName, "recipe_name", upper=False)
        )
        for name in ("pad_inner_dim", "enable_fsdp_float8_all_gather", "emulate"):
            check_bool(getattr(self, name), name)
        # torchao asserts this in Float8LinearConfig.__post_init__; say it here, before any work starts.
        if self.enable_fsdp_float8_all_gather and self.recipe_name is not AORecipeName.TENSORWISE:
            raise RecipeError(
                "enable_fsdp_float8_all_gather works only with recipe_name tensorwise "
                f"(torchao gathers tensorwise-scaled weights), got recipe_name {self.recipe_name.value}.",
                field="enable_fsdp_float8_all_gather",
            )

    @property
    def backend(self) -> Backend:
        return Backend.AO

    @property
    def scaling(self) -> AORecipeName:
        return self.recipe_name

    @property
    def library_class(self) -> str:
        return f"torchao Float8Linear ({self.recipe_name.value})"

    def state_note(self) -> str:
        return stateless_note(self.library_class)

    def shape_rule(self) -> ShapeRule:
        return FP8_RULE

    def hardware(self) -> Hardware:
        return ANY_DEVICE if self.emulate else TORCH_FP8_GPU

    def cast_formats(self) -> dict[str, str]:
        return dict(AO_LINEAR_CAST_FORMATS[self.recipe_name])

    def warnings(self) -> list[str]:
        return []

    def block_scaled(self) -> bool:
        """Whether a forward cast is block-scaled (MXFP8, NVFP4, FP8 blocks): no per-tensor scale applies."""
        return any("block" in spec for spec in self.cast_formats().values())
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """The recipe ``data`` describes; RecipeError (field ``backend``) unless it is a ``cls``."""
        return typed_from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": RECIPE_VERSION,
            "backend": self.backend.value,
            "recipe_name": self.recipe_name.value,
            "pad_inner_dim": self.pad_inner_dim,
            "enable_fsdp_float8_all_gather": self.enable_fsdp_float8_all_gather,
            "emulate": self.emulate,
            **self.serving_options(),
        }
