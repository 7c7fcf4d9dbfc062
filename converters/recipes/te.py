"""TransformerEngine's per-tensor FP8 recipes: ``DelayedScaling`` (the default) and ``Float8CurrentScaling``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from converters.errors import RecipeError
from converters.recipes.base import (
    MAX_AMAX_HISTORY_LEN,
    MAX_INTERVAL,
    MAX_MARGIN,
    RECIPE_VERSION,
    AmaxComputeAlgo,
    Backend,
    Fp8Format,
    TEScaling,
    brief,
    check_bool,
    check_fp8_format,
    check_int,
    coerce_enum,
)
from converters.recipes.registry import register_recipe, typed_from_dict
from converters.recipes.requirements import FP8_GPU, FP8_RULE, Hardware, ShapeRule, stateless_note
from converters.recipes.serving_options import ServingOptions

__all__ = ["TEDelayedScalingRecipe", "TECurrentScalingRecipe"]

_PER_TENSOR_CASTS = {"input": "e4m3_tensor", "weight": "e4m3_tensor"}


class _PerTensorFP8:
    """What TE's per-tensor FP8 recipes (delayed and current scaling) share: dims % 16, FP8 GPUs, E4M3 casts."""

    training_op: ClassVar[bool] = False
    per_tensor_te: ClassVar[bool] = True

    def block_scaled(self) -> bool:
        return False

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """The recipe ``data`` describes; RecipeError (field ``backend``) unless it is a ``cls``."""
        return typed_from_dict(cls, data)

    def shape_rule(self) -> ShapeRule:
        return FP8_RULE

    def hardware(self) -> Hardware:
        return FP8_GPU

    def cast_formats(self) -> dict[str, str]:
        """Forward casts: E4M3 per tensor (HYBRID changes only the gradients, to E5M2 per tensor)."""
        return dict(_PER_TENSOR_CASTS)


@register_recipe(Backend.TE, TEScaling.DELAYED)
@dataclass(frozen=True, kw_only=True)
class TEDelayedScalingRecipe(_PerTensorFP8, ServingOptions):
    """TransformerEngine ``DelayedScaling``: per-tensor scales from an amax history.

    ``interval`` and ``override_linear_precision`` are Accelerate keys that TransformerEngine no longer
    has (its pydantic dataclass drops them silently); they are kept here so that nothing the user wrote
    disappears, and :meth:`warnings` says they have no effect.
    """

    te_class_name: ClassVar[str] = "DelayedScaling"
    stateful: ClassVar[bool] = True  #: TE keeps an amax history and scale per tensor: seeded from calibration

    fp8_format: Fp8Format = Fp8Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: AmaxComputeAlgo = AmaxComputeAlgo.MAX
    margin: int = 0
    interval: int | None = None
    override_linear_precision: tuple[bool, bool, bool] | None = None
    use_autocast_during_eval: bool = False

    def __post_init__(self) -> None:
        self._check_serving_options()
        object.__setattr__(self, "fp8_format", check_fp8_format(self.fp8_format))
        object.__setattr__(
            self,
            "amax_compute_algo",
            coerce_enum(self.amax_compute_algo, AmaxComputeAlgo, "amax_compute_algo", upper=False),
        )
        check_int(self.amax_history_len, "amax_history_len", minimum=1, maximum=MAX_AMAX_HISTORY_LEN)
        check_int(self.margin, "margin", minimum=0, maximum=MAX_MARGIN)
        check_int(self.interval, "interval", minimum=1, maximum=MAX_INTERVAL, optional=True)
        check_bool(self.use_autocast_during_eval, "use_autocast_during_eval")
        olp = self.override_linear_precision
        if olp is not None:
            if (
                not isinstance(olp, (tuple, list))
                or len(olp) != 3
                or not all(isinstance(v, bool) for v in olp)
            ):
                raise RecipeError(
                    "override_linear_precision must be three booleans (fprop, dgrad, wgrad) or null, "
                    f"got {brief(olp)}.",
                    field="override_linear_precision",
                )
            object.__setattr__(self, "override_linear_precision", tuple(olp))

    @property
    def backend(self) -> Backend:
        return Backend.TE

    @property
    def scaling(self) -> TEScaling:
        return TEScaling.DELAYED

    @property
    def library_class(self) -> str:
        return "TransformerEngine DelayedScaling"

    def state_note(self) -> str:
        return (f"amax history ({self.amax_history_len} rows) and scale per tensor, seeded from the calibration as "
                "TE's own update would compute them (fp8_state.safetensors)")


    def warnings(self) -> list[str]:
        """Human-readable notes about fields that are recorded but change nothing."""
        notes = []
        for name in ("interval", "override_linear_precision"):
            if getattr(self, name) is not None:
                notes.append(f"{name} was removed from TransformerEngine; it is recorded but has no effect.")
        return notes

    def te_recipe_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``transformer_engine.common.recipe.DelayedScaling``.

        ``fp8_format`` is the ``Format`` member name; the caller resolves it with
        ``getattr(Format, name)`` so that this module never imports TransformerEngine.
        """
        return {
            "fp8_format": self.fp8_format.value,
            "amax_history_len": self.amax_history_len,
            "amax_compute_algo": self.amax_compute_algo.value,
            "margin": self.margin,
        }

    def te_qparams(self) -> dict[str, dict[str, Any]]:
        return {}

    def to_dict(self) -> dict[str, Any]:
        olp = self.override_linear_precision
        return {
            "version": RECIPE_VERSION,
            "backend": self.backend.value,
            "scaling": self.scaling.value,
            "fp8_format": self.fp8_format.value,
            "amax_history_len": self.amax_history_len,
            "amax_compute_algo": self.amax_compute_algo.value,
            "margin": self.margin,
            "interval": self.interval,
            "override_linear_precision": list(olp) if olp is not None else None,
            "use_autocast_during_eval": self.use_autocast_during_eval,
            **self.serving_options(),
        }



@register_recipe(Backend.TE, TEScaling.CURRENT)
@dataclass(frozen=True, kw_only=True)
class TECurrentScalingRecipe(_PerTensorFP8, ServingOptions):
    """TransformerEngine ``Float8CurrentScaling``: stateless, each cast scales by its own amax."""

    te_class_name: ClassVar[str] = "Float8CurrentScaling"
    stateful: ClassVar[bool] = False

    fp8_format: Fp8Format = Fp8Format.HYBRID

    def __post_init__(self) -> None:
        self._check_serving_options()
        object.__setattr__(self, "fp8_format", check_fp8_format(self.fp8_format))

    @property
    def backend(self) -> Backend:
        return Backend.TE

    @property
    def scaling(self) -> TEScaling:
        return TEScaling.CURRENT

    @property
    def library_class(self) -> str:
        return "TransformerEngine Float8CurrentScaling"

    def state_note(self) -> str:
        return stateless_note(self.library_class)


    def warnings(self) -> list[str]:
        return []

    def te_recipe_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``Float8CurrentScaling`` (``fp8_format`` as a ``Format`` name)."""
        return {"fp8_format": self.fp8_format.value}

    def te_qparams(self) -> dict[str, dict[str, Any]]:
        return {}

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": RECIPE_VERSION,
            "backend": self.backend.value,
            "scaling": self.scaling.value,
            "fp8_format": self.fp8_format.value,
            **self.serving_options(),
        }
