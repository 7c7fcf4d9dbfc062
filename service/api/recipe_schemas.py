"""The recipe of a job as typed request models: one per backend and scaling, chosen by ``backend``/``scaling``.

``te``: ``scaling`` delayed (default), current, mxfp8_block, float8_block, nvfp4_block (one TransformerEngine recipe
class each); ``ao``: no ``scaling`` (a ``Float8Linear`` ``recipe_name``), or ``scaling`` float8_training_op /
mxfp8_training_op (torchao's ``quantize_`` training configs). Cross-field rules a schema cannot state (two 2-D
block dims in one GEMM, 4over6 activations with RHT, FSDP all-gather off tensorwise) are the library's to refuse.

The conversion library (``converters.recipes``) stays the authority and checks the recipe again before a job
is queued; these models state its fields, enums and bounds in the OpenAPI schema and refuse anything that
is not exactly right. The API takes the canonical spellings only: the library's extra leniency (``TE`` in
capitals, Accelerate's ``amax_history_length``) is for recipe files given to the command line.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, GetPydanticSchema, Tag
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import core_schema

from converters.recipes import (
    MAX_AMAX_HISTORY_LEN,
    MAX_INTERVAL,
    MAX_MARGIN,
    RECIPE_VERSION,
    AmaxComputeAlgo,
    AOFloat8TrainingOpRecipe,
    AOMXFP8TrainingOpRecipe,
    AORecipeName,
    AOTrainingOp,
    Fp8Format,
    MXKernelPreference,
    MXScaleCalculationMode,
    NVFP4ErrMode,
    NVFP4Scope,
    NVFP4Smoothing,
    NVFP4WeightRounding,
    NVFP4WeightScales,
    TEDelayedScalingRecipe,
    TEFloat8BlockScalingRecipe,
    TEMXFP8BlockScalingRecipe,
    TENVFP4BlockScalingRecipe,
    TEScaling,
    TorchAORecipe,
)

__all__ = [
    "STRICT", "json_int", "RecipeCreate", "TEDelayedRecipeCreate", "TECurrentRecipeCreate", "TEMXFP8RecipeCreate",
    "TEFloat8BlockRecipeCreate", "TENVFP4RecipeCreate", "TorchAORecipeCreate", "AOFloat8TrainingOpRecipeCreate",
    "AOMXFP8TrainingOpRecipeCreate",
]

# Strict: a JSON value of the wrong type is refused ("8" is not an integer, "yes" is not a boolean)
STRICT = ConfigDict(extra="forbid", strict=True)


def _integral(value: Any) -> Any:
    # JSON has one number type and JSON Schema calls 8.0 an integer; strings and booleans stay refused
    return int(value) if isinstance(value, float) and value.is_integer() else value


def json_int(low: int, high: int) -> Any:
    """An integer from ``low`` to ``high`` as JSON Schema means it: 8 or 8.0, never "8" or true."""
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(_integral)]
_TE = TEDelayedScalingRecipe()
_AO = TorchAORecipe()
_MX = TEMXFP8BlockScalingRecipe()
_BLOCK = TEFloat8BlockScalingRecipe()
_NV = TENVFP4BlockScalingRecipe()
_AO_F8 = AOFloat8TrainingOpRecipe()
_AO_MX = AOMXFP8TrainingOpRecipe()
BlockDim = Annotated[json_int(1, 2), Field(description="1: 1x128 blocks; 2: 128x128 blocks.")]

Version = Annotated[Literal[1], Field(description=f"Recipe format version ({RECIPE_VERSION}).")]


class _RecipeCreate(BaseModel):
    """What every recipe model shares: strict fields (JSON types as they are, no extra keys) and the version."""

    model_config = STRICT
    version: Version = RECIPE_VERSION
    nvfp4_weight_scales: NVFP4WeightScales = Field(
        NVFP4WeightScales.RTN, strict=False,
        description="How the nvfp4 / nvfp4-a16 serving exports choose their E4M3 weight block scales: rtn (block "
                    "amax to 6, llm-compressor's bytes), mse (least squared error among nearby E4M3 scales), "
                    "four_over_six (block amax to 6 or to 4, whichever errs less). docs/recipes.md.")
    nvfp4_weight_rounding: NVFP4WeightRounding = Field(
        NVFP4WeightRounding.NEAREST, strict=False,
        description="How the NVFP4 serving exports (nvfp4, nvfp4-a16, modelopt-nvfp4) round their weights under their "
                    "scales: nearest (each value on its own, the peers' bytes) or gptq (each column's output error on "
                    "the calibration inputs fed to the columns not yet rounded, decoder layer by decoder layer). "
                    "docs/recipes.md.")
    nvfp4_smoothing: NVFP4Smoothing = Field(
        NVFP4Smoothing.NONE, strict=False,
        description="Whether the job first smooths its source for the NVFP4 W4A4 exports (nvfp4, modelopt-nvfp4): "
                    "none, or awq (per decoder Linear group, per-input-channel scales chosen by AWQ's ratio search "
                    "for the least W4A4 output error on the calibration inputs, folded into the norm or Linear that "
                    "feeds the group; the job then converts the smoothed model). docs/recipes.md.")


class TEDelayedRecipeCreate(_RecipeCreate):
    """TransformerEngine ``DelayedScaling``: per-tensor scales from an amax history (the default recipe)."""

    backend: Literal["te"]
    scaling: Literal["delayed"] = "delayed"
    # strict=False only lets pydantic take the enum's value from the parsed JSON; anything else is refused
    fp8_format: Fp8Format = Field(_TE.fp8_format, strict=False)
    amax_history_len: json_int(1, MAX_AMAX_HISTORY_LEN) = Field(
        _TE.amax_history_len,
        description=f"Steps of amax history per tensor, 1..{MAX_AMAX_HISTORY_LEN} (TE's default "
                    f"{_TE.amax_history_len}; 16..1024 in practice). Each Linear keeps this many fp32 rows.")
    amax_compute_algo: AmaxComputeAlgo = Field(_TE.amax_compute_algo, strict=False)
    margin: json_int(0, MAX_MARGIN) = Field(_TE.margin,
                        description=f"Scale by 2**-margin, 0..{MAX_MARGIN}.")
    interval: json_int(1, MAX_INTERVAL) | None = Field(None,
                                 description="Removed from TransformerEngine: recorded, with no effect.")
    override_linear_precision: list[bool] | None = Field(
        None, min_length=3, max_length=3,
        description="Removed from TransformerEngine: three booleans (fprop, dgrad, wgrad), recorded, no effect.")
    use_autocast_during_eval: bool = _TE.use_autocast_during_eval


class TECurrentRecipeCreate(_RecipeCreate):
    """TransformerEngine ``Float8CurrentScaling``: stateless, each cast scales by its own amax."""

    backend: Literal["te"]
    scaling: Literal["current"]
    fp8_format: Fp8Format = Field(_TE.fp8_format, strict=False)


class TorchAORecipeCreate(_RecipeCreate):
    """torchao ``Float8LinearConfig.from_recipe_name(recipe_name)`` plus per-linear options.

    ``enable_fsdp_float8_all_gather`` works only with ``recipe_name`` tensorwise (refused otherwise).
    """

    backend: Literal["ao"]
    recipe_name: AORecipeName = Field(_AO.recipe_name, strict=False)
    pad_inner_dim: bool = _AO.pad_inner_dim
    enable_fsdp_float8_all_gather: bool = _AO.enable_fsdp_float8_all_gather
    emulate: bool = _AO.emulate


class TEMXFP8RecipeCreate(_RecipeCreate):
    """TransformerEngine ``MXFP8BlockScaling``: E4M3 in blocks of 32 values with E8M0 (power-of-two) scales; no state.

    Runs on compute capability 10.x/11.x (Blackwell); Linear dims must be multiples of 32. Accelerate's
    ``use_mxfp8_block_scaling: true`` is this recipe (send it as ``scaling``).
    """

    backend: Literal["te"]
    scaling: Literal["mxfp8_block"]
    fp8_format: Fp8Format = Field(_MX.fp8_format, strict=False,
                                  description="E4M3 (TE's default here) or HYBRID (E5M2 blocks for gradients).")
    margin: json_int(0, MAX_MARGIN) = Field(_MX.margin, description=f"TE's margin field, 0..{MAX_MARGIN}.")
    enable_2d_quantization: bool = Field(_MX.enable_2d_quantization,
                                         description="32x32 blocks for weights (TE 2.20 development head and later).")


class TEFloat8BlockRecipeCreate(_RecipeCreate):
    """TransformerEngine ``Float8BlockScaling``: E4M3 with one fp32 scale per 1x128 or 128x128 block; no state.

    Runs on compute capability 9.0+ with CUDA 12.9+ (9.x only with ``use_f32_scales``); Linear dims must be multiples
    of 128. No two operands of one GEMM may both use 128x128 blocks (refused by the library).
    """

    backend: Literal["te"]
    scaling: Literal["float8_block"]
    fp8_format: Fp8Format = Field(_BLOCK.fp8_format, strict=False)
    use_f32_scales: bool = Field(_BLOCK.use_f32_scales,
                                 description="fp32 block scales instead of powers of two (Hopper only).")
    x_block_scaling_dim: BlockDim = _BLOCK.x_block_scaling_dim
    w_block_scaling_dim: BlockDim = _BLOCK.w_block_scaling_dim
    grad_block_scaling_dim: BlockDim = _BLOCK.grad_block_scaling_dim


class TENVFP4RecipeCreate(_RecipeCreate):
    """TransformerEngine ``NVFP4BlockScaling``: FP4 (E2M1) in blocks of 16 with E4M3 scales and an fp32 tensor scale.

    Runs on compute capability 10.0+; Linear dims must be multiples of 128. ``nvfp4_4over6`` activations or all
    need ``disable_rht`` (refused by the library otherwise).
    """

    backend: Literal["te"]
    scaling: Literal["nvfp4_block"]
    disable_rht: bool = _NV.disable_rht
    disable_stochastic_rounding: bool = _NV.disable_stochastic_rounding
    disable_2d_quantization: bool = Field(_NV.disable_2d_quantization,
                                          description="1-D blocks of 16 for weights too (default: 16x16 blocks).")
    row_scaled_activation: bool = _NV.row_scaled_activation
    nvfp4_4over6: NVFP4Scope = Field(_NV.nvfp4_4over6, strict=False)
    nvfp4_4over6_e4m3_use_256: NVFP4Scope = Field(_NV.nvfp4_4over6_e4m3_use_256, strict=False)
    nvfp4_4over6_err_mode: NVFP4ErrMode = Field(_NV.nvfp4_4over6_err_mode, strict=False)


class AOFloat8TrainingOpRecipeCreate(_RecipeCreate):
    """torchao ``Float8TrainingOpConfig`` applied with ``quantize_``: the Linear weights become FP8 training tensors."""

    backend: Literal["ao"]
    scaling: Literal["float8_training_op"]
    float8_linear_recipe: AORecipeName = Field(_AO_F8.float8_linear_recipe, strict=False)
    pad_token_groups_for_grouped_mm: bool = _AO_F8.pad_token_groups_for_grouped_mm


class AOMXFP8TrainingOpRecipeCreate(_RecipeCreate):
    """torchao ``MXFP8TrainingOpConfig`` applied with ``quantize_``: MXFP8 matmuls (Blackwell, or emulated)."""

    backend: Literal["ao"]
    scaling: Literal["mxfp8_training_op"]
    kernel_preference: MXKernelPreference = Field(_AO_MX.kernel_preference, strict=False)
    wgrad_with_hp: bool = _AO_MX.wgrad_with_hp
    scale_calculation_mode: MXScaleCalculationMode = Field(_AO_MX.scale_calculation_mode, strict=False)
    pad_token_groups_for_grouped_mm: bool = _AO_MX.pad_token_groups_for_grouped_mm


def _refusal(field: str, choices: tuple[str, ...]) -> Any:
    """A union member that never validates: a recipe whose ``field`` is missing or unknown lands here and is
    refused as ``recipe.<field>``. A bare core schema, not a model: FastAPI would list a model among the OpenAPI
    components although the union leaves it out of the schema."""
    schema = core_schema.typed_dict_schema(
        {field: core_schema.typed_dict_field(core_schema.literal_schema(list(choices)))}, extra_behavior="allow")
    return SkipJsonSchema[Annotated[dict, GetPydanticSchema(lambda _type, _handler: schema)]]


def _variant(value: Any) -> str | None:
    """The tag of the model that validates ``value`` (tags are bracketed: they appear in error locations)."""
    if isinstance(value, BaseModel):
        value = value.model_dump()
    if not isinstance(value, dict):
        return None
    backend = value.get("backend")
    if backend not in ("te", "ao"):
        return "[unknown backend]"
    scaling = value.get("scaling", "delayed" if backend == "te" else None)
    if backend == "ao" and scaling is None:
        return "[ao]"
    tag = f"[{backend} {scaling}]" if isinstance(scaling, str) else None
    return tag if tag in _TAGS else f"[unknown {backend} scaling]"


_TE_TAGS = {f"[te {m.value}]": model for m, model in zip(TEScaling, (
    TEDelayedRecipeCreate, TECurrentRecipeCreate, TEMXFP8RecipeCreate, TEFloat8BlockRecipeCreate, TENVFP4RecipeCreate),
    strict=True)}
_AO_TAGS = {f"[ao {m.value}]": model for m, model in zip(AOTrainingOp, (
    AOFloat8TrainingOpRecipeCreate, AOMXFP8TrainingOpRecipeCreate), strict=True)}
_TAGS = {**_TE_TAGS, **_AO_TAGS}

RecipeCreate = Annotated[
    Annotated[TEDelayedRecipeCreate, Tag("[te delayed]")]
    | Annotated[TECurrentRecipeCreate, Tag("[te current]")]
    | Annotated[TEMXFP8RecipeCreate, Tag("[te mxfp8_block]")]
    | Annotated[TEFloat8BlockRecipeCreate, Tag("[te float8_block]")]
    | Annotated[TENVFP4RecipeCreate, Tag("[te nvfp4_block]")]
    | Annotated[TorchAORecipeCreate, Tag("[ao]")]
    | Annotated[AOFloat8TrainingOpRecipeCreate, Tag("[ao float8_training_op]")]
    | Annotated[AOMXFP8TrainingOpRecipeCreate, Tag("[ao mxfp8_training_op]")]
    | Annotated[_refusal("backend", ("te", "ao")), Tag("[unknown backend]")]
    | Annotated[_refusal("scaling", tuple(m.value for m in TEScaling)), Tag("[unknown te scaling]")]
    | Annotated[_refusal("scaling", tuple(m.value for m in AOTrainingOp)), Tag("[unknown ao scaling]")],
    Discriminator(_variant, custom_error_type="recipe_type",
                  custom_error_message='recipe must be a JSON object like {"backend": "te"}'),
]
