"""TransformerEngine's block-scaled recipes: ``MXFP8BlockScaling``, ``Float8BlockScaling``, ``NVFP4BlockScaling``.

Fields and defaults are TE's (``transformer_engine/common/recipe/__init__.py``; MXFP8 since TE 2.0,
Float8BlockScaling since 2.3, NVFP4 since 2.8, ``enable_2d_quantization`` on the 2.20 development head). TE
reads some defaults from environment variables (``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``,
``NVTE_NVFP4_DISABLE_RHT``, ...); a recipe here takes the value TE has when they are unset, and the loader
passes every recorded field to TE explicitly, so the environment of the training job cannot change the recipe
an artifact was written for. TE's attention options (``fp8_dpa``, ``fp8_mha``) and ``backward_override`` are not
recipe fields here: fp8forge converts Linear layers, and leaves both at TE's defaults.

All three are stateless: TE computes each block's scale from the tensor as it casts it, so an artifact
holds no FP8 state for them. No torch or TE import here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from converters.errors import RecipeError
from converters.recipes.base import (
    MAX_MARGIN,
    RECIPE_VERSION,
    Backend,
    Fp8Format,
    NVFP4ErrMode,
    NVFP4Scope,
    TEScaling,
    check_bool,
    check_fp8_format,
    check_int,
    coerce_enum,
)
from converters.recipes.registry import register_recipe, typed_from_dict
from converters.recipes.requirements import (
    FP8_BLOCK_F32_SCALES_GPU,
    FP8_BLOCK_GPU,
    FP8_BLOCK_RULE,
    MXFP8_GPU,
    MXFP8_RULE,
    NVFP4_GPU,
    NVFP4_RULE,
    Hardware,
    ShapeRule,
    stateless_note,
)
from converters.recipes.serving_options import SERVING_KEY, ServingOptions

__all__ = ["TEMXFP8BlockScalingRecipe", "TEFloat8BlockScalingRecipe", "TENVFP4BlockScalingRecipe"]


class _TEBlockRecipe:
    """What the three block-scaled TE recipes share (a mixin of methods; each subclass is the dataclass)."""

    training_op: ClassVar[bool] = False
    per_tensor_te: ClassVar[bool] = False

    def block_scaled(self) -> bool:
        """Whether a forward cast is block-scaled (MXFP8, NVFP4, FP8 blocks): no per-tensor scale applies."""
        return any("block" in spec for spec in self.cast_formats().values())

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """The recipe ``data`` describes; RecipeError (field ``backend``) unless it is a ``cls``."""
        return typed_from_dict(cls, data)

    te_class_name: ClassVar[str]
    scaling_value: ClassVar[TEScaling]
    stateful: ClassVar[bool] = False  #: no amax history: nothing to seed from calibration

    @property
    def backend(self) -> Backend:
        return Backend.TE

    @property
    def scaling(self) -> TEScaling:
        return self.scaling_value

    @property
    def library_class(self) -> str:
        return f"TransformerEngine {self.te_class_name}"

    def state_note(self) -> str:
        return stateless_note(self.library_class)

    def warnings(self) -> list[str]:
        return []

    def te_recipe_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for TE's recipe class (enum members as their names; the caller resolves ``Format``)."""
        return {name: value.value if hasattr(value, "value") else value for name, value in self._fields().items()}

    def te_qparams(self) -> dict[str, dict[str, Any]]:
        """``QParams`` instance attributes to set on the built TE recipe (none unless a subclass says so)."""
        return {}

    def to_dict(self) -> dict[str, Any]:
        return {"version": RECIPE_VERSION, "backend": self.backend.value, "scaling": self.scaling.value,
                **self.te_recipe_kwargs(), **self.serving_options()}

    def _fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.metadata.get("recipe_key", True)
                and not f.metadata.get(SERVING_KEY)}



@register_recipe(Backend.TE, TEScaling.MXFP8_BLOCK)
@dataclass(frozen=True, kw_only=True)
class TEMXFP8BlockScalingRecipe(_TEBlockRecipe, ServingOptions):
    """TransformerEngine ``MXFP8BlockScaling``: E4M3 values in blocks of 32 consecutive elements, each block with
    its own E8M0 (power-of-two) scale; TE casts a tensor and its transpose separately from high precision.

    Accelerate's ``use_mxfp8_block_scaling: true`` selects this recipe.
    """

    te_class_name: ClassVar[str] = "MXFP8BlockScaling"
    scaling_value: ClassVar[TEScaling] = TEScaling.MXFP8_BLOCK

    fp8_format: Fp8Format = Fp8Format.E4M3  #: TE's default here is E4M3 (HYBRID: E5M2 blocks for gradients)
    margin: int = 0
    enable_2d_quantization: bool = False  #: 2-D (32x32) blocks for weights; TE 2.20 development head only
    #: Accelerate keys of the parsed fp8_config that Accelerate drops for MXFP8 too (not a recipe key: for warnings)
    accelerate_ignored: tuple[str, ...] = field(default=(), compare=False, repr=False, metadata={"recipe_key": False})

    def __post_init__(self) -> None:
        self._check_serving_options()
        object.__setattr__(self, "fp8_format", check_fp8_format(self.fp8_format))
        check_int(self.margin, "margin", minimum=0, maximum=MAX_MARGIN)
        check_bool(self.enable_2d_quantization, "enable_2d_quantization")
        object.__setattr__(self, "accelerate_ignored", tuple(self.accelerate_ignored))

    def warnings(self) -> list[str]:
        return [f"{name} has no effect with MXFP8BlockScaling (stateless, no amax history); Accelerate drops it too, "
                "and it is not recorded" for name in self.accelerate_ignored]

    def shape_rule(self) -> ShapeRule:
        return MXFP8_RULE

    def hardware(self) -> Hardware:
        return MXFP8_GPU

    def cast_formats(self) -> dict[str, str]:
        """Forward casts (HYBRID changes only the gradients)."""
        weight = "mxfp8_e4m3_block32x32" if self.enable_2d_quantization else "mxfp8_e4m3_block32"
        return {"input": "mxfp8_e4m3_block32", "weight": weight}


@register_recipe(Backend.TE, TEScaling.FLOAT8_BLOCK)
@dataclass(frozen=True, kw_only=True)
class TEFloat8BlockScalingRecipe(_TEBlockRecipe, ServingOptions):
    """TransformerEngine ``Float8BlockScaling``: E4M3 values with one fp32 scale per block of 128 values (1x128,
    ``*_block_scaling_dim`` 1) or 128x128 values (dim 2); by default activations and gradients 1x128, weights
    128x128, scales rounded to powers of two.
    """

    te_class_name: ClassVar[str] = "Float8BlockScaling"
    scaling_value: ClassVar[TEScaling] = TEScaling.FLOAT8_BLOCK

    fp8_format: Fp8Format = Fp8Format.E4M3
    #: fp32 scales instead of powers of two (TE: env NVTE_FP8_BLOCK_SCALING_FP32_SCALES); Hopper only.
    use_f32_scales: bool = False
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1

    def __post_init__(self) -> None:
        self._check_serving_options()
        object.__setattr__(self, "fp8_format", check_fp8_format(self.fp8_format))
        check_bool(self.use_f32_scales, "use_f32_scales")
        dims = ("x_block_scaling_dim", "w_block_scaling_dim", "grad_block_scaling_dim")
        for name in dims:
            check_int(getattr(self, name), name, minimum=1, maximum=2)
        # TE's __post_init__ asserts "2D by 2D block gemm not supported" for each pair that meets in a GEMM.
        for first, second in (dims[:2], (dims[0], dims[2]), dims[1:]):
            if getattr(self, first) == 2 and getattr(self, second) == 2:
                raise RecipeError(f"{second} cannot be 2 while {first} is 2: TransformerEngine has no GEMM of two "
                                  "128x128-block operands (\"2D by 2D block gemm not supported\")", field=second)

    def te_qparams(self) -> dict[str, dict[str, Any]]:
        # TE builds these QParams at class definition from the environment (not from use_f32_scales, which its
        # quantizers never read): set on the instance, they make the recorded field the one TE uses.
        params = {"power_2_scale": not self.use_f32_scales, "amax_epsilon": 0.0}
        return {name: dict(params) for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad")}

    def shape_rule(self) -> ShapeRule:
        return FP8_BLOCK_RULE

    def hardware(self) -> Hardware:
        return FP8_BLOCK_F32_SCALES_GPU if self.use_f32_scales else FP8_BLOCK_GPU

    def cast_formats(self) -> dict[str, str]:
        """Forward casts: 1x128 or 128x128 blocks by ``x_`` / ``w_block_scaling_dim`` (HYBRID: gradients only)."""
        block = {1: "e4m3_block_1x128", 2: "e4m3_block_128x128"}
        return {"input": block[self.x_block_scaling_dim], "weight": block[self.w_block_scaling_dim]}


@register_recipe(Backend.TE, TEScaling.NVFP4_BLOCK)
@dataclass(frozen=True, kw_only=True)
class TENVFP4BlockScalingRecipe(_TEBlockRecipe, ServingOptions):
    """TransformerEngine ``NVFP4BlockScaling``: FP4 (E2M1) values, one E4M3 scale per 16 values and one fp32 scale
    per tensor; by default 16x16 blocks for weights, random Hadamard transforms on the wgrad operands and
    stochastic rounding for gradients (``fp4_format`` E2M1 and ``fp8_format`` E4M3 are the only values TE takes).
    """

    te_class_name: ClassVar[str] = "NVFP4BlockScaling"
    scaling_value: ClassVar[TEScaling] = TEScaling.NVFP4_BLOCK

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    row_scaled_activation: bool = False  #: TE >= 2.16
    nvfp4_4over6: NVFP4Scope = NVFP4Scope.NONE  #: TE >= 2.18, like the two below
    nvfp4_4over6_e4m3_use_256: NVFP4Scope = NVFP4Scope.ALL
    nvfp4_4over6_err_mode: NVFP4ErrMode = NVFP4ErrMode.MAE

    def __post_init__(self) -> None:
        self._check_serving_options()
        for name in ("disable_rht", "disable_stochastic_rounding", "disable_2d_quantization", "row_scaled_activation"):
            check_bool(getattr(self, name), name)
        for name in ("nvfp4_4over6", "nvfp4_4over6_e4m3_use_256"):
            object.__setattr__(self, name, coerce_enum(getattr(self, name), NVFP4Scope, name, upper=False))
        object.__setattr__(self, "nvfp4_4over6_err_mode",
                           coerce_enum(self.nvfp4_4over6_err_mode, NVFP4ErrMode, "nvfp4_4over6_err_mode", upper=True))
        # TE raises "NVFP4 4over6 quantization does not support RHT" when it builds the quantizers of the first
        # step (NVFP4BlockScalingRecipeState.make_quantizers); activations get RHT unless disable_rht.
        if self.nvfp4_4over6 in (NVFP4Scope.ACTIVATIONS, NVFP4Scope.ALL) and not self.disable_rht:
            raise RecipeError(f"nvfp4_4over6 {self.nvfp4_4over6.value} needs disable_rht true: TransformerEngine's "
                              "4over6 quantization does not support the random Hadamard transform of activations",
                              field="nvfp4_4over6")

    def shape_rule(self) -> ShapeRule:
        return NVFP4_RULE

    def hardware(self) -> Hardware:
        return NVFP4_GPU

    def cast_formats(self) -> dict[str, str]:
        """Forward casts (RHT applies to the wgrad operands only; 4over6 and row-scaled activations keep the
        block layout and change how scales are chosen)."""
        weight = "nvfp4_block16" if self.disable_2d_quantization else "nvfp4_block16x16"
        return {"input": "nvfp4_block16", "weight": weight}
