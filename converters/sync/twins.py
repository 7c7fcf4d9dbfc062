"""Which serving format holds, bit for bit, the FP8 weights a training recipe casts: its training twin.

A recipe's forward casts each Linear weight from high precision at every step; the twin writes that cast once,
in a layout an inference engine reads, so a rollout engine runs exactly the trained model's FP8 weights. The
recipe picks the layout (its weight blocks and scales) and the cast (its library's arithmetic): the twin is the
format with that pair (:func:`converters.serving_names.training_twin_name`). Each entry names the tests that hold
it to the training library's own cast (``checked_by``).

| recipe | twin |
| --- | --- |
| TE ``Float8BlockScaling`` (128x128 weights), power-of-two scales | ``fp8-block-ue8m0-te`` |
| TE ``Float8BlockScaling`` (128x128 weights), fp32 scales | ``fp8-block-te`` |
| TE ``MXFP8BlockScaling`` (1-D blocks of 32) | ``mxfp8-te`` |
| TE ``Float8CurrentScaling`` (per-tensor fp32 scales) | ``compressed-tensors-fp8-te-tensorwise`` |
| torchao ``Float8Linear`` / ``Float8TrainingOpConfig`` tensorwise | ``compressed-tensors-fp8-torchao-tensorwise`` |
| the same, rowwise and rowwise_with_gw_hp | ``compressed-tensors-fp8-torchao-rowwise`` |
| torchao ``MXFP8TrainingOpConfig`` RCEIL / FLOOR | ``mxfp8-rceil`` / ``mxfp8-floor`` |

No twin: TE ``DelayedScaling`` (its weight scale comes from an amax history, not from the weight), TE
``NVFP4BlockScaling``, 1x128 weight blocks and 2-D (32x32) MXFP8 weight blocks.
No torch import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from converters.errors import RequestError
from converters.recipes.base import AORecipeName, MXScaleCalculationMode, TEScaling
from converters.serving_names import Layout, WeightCast, training_twin_name

__all__ = ["TrainingTwin", "training_twin", "twin_report"]

_TORCHAO_TEST = "tests/converters/serving/test_training_twin_torchao.py"
_TE_TEST = "tests/converters/serving/test_training_twin_te.py"


@dataclass(frozen=True, kw_only=True)
class TrainingTwin:
    """A recipe's serving twin: its layout and cast, the recipe in words, and how the identity is checked."""

    layout: Layout
    cast: WeightCast
    scale_mode: str | None = None  #: torchao MXFP8's rounding (rceil, floor), the one cast with two in a layout
    recipe: str
    checked_by: str
    caveat: str = ""

    @property
    def format(self) -> str:
        """The serving format's name (what ``--format`` and ``serving_formats`` take)."""
        return training_twin_name(self.layout, self.cast, self.scale_mode)

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "layout": self.layout.value, "cast": self.cast.value,
                "recipe": self.recipe, "checked_by": self.checked_by, "caveat": self.caveat}


def training_twin(recipe: Any) -> TrainingTwin:
    """The twin of ``recipe`` (a recipe object of :mod:`converters.recipes`).

    Raises:
        RequestError (field ``format``): the recipe has no serving twin; the message says why and what to pass.
    """
    scaling = getattr(recipe, "scaling", None)
    library = getattr(recipe, "library_class", type(recipe).__name__)
    if scaling is TEScaling.FLOAT8_BLOCK and recipe.w_block_scaling_dim == 2:
        pow2 = not recipe.use_f32_scales
        return TrainingTwin(
            layout=Layout.FP8_BLOCK_UE8M0 if pow2 else Layout.FP8_BLOCK, cast=WeightCast.TE,
            recipe=f"{library}, 128x128 weight blocks, {'power-of-two' if pow2 else 'fp32'} scales",
            checked_by=f"{_TE_TEST}: TE's Python reference of the block cast on CPU (held to its CUDA kernel by TE's "
                       "test_float8_blockwise_scaling_exact.py); TE's Float8BlockQuantizer on a CUDA machine")
    if scaling is TEScaling.CURRENT:
        return TrainingTwin(
            layout=Layout.COMPRESSED_TENSORS_FP8_PER_TENSOR_DYNAMIC, cast=WeightCast.TE,
            recipe=f"{library}, per-tensor fp32 scale",
            checked_by=f"{_TE_TEST}: TE's Python reference of the current-scaling cast on CPU; TE's "
                       "Float8CurrentScalingQuantizer on a CUDA machine",
            caveat="a training job run with NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1 (not recorded in the recipe) "
                   "rounds its scales to powers of two: not this twin")
    if scaling is TEScaling.MXFP8_BLOCK and not recipe.enable_2d_quantization:
        return TrainingTwin(
            layout=Layout.MXFP8, cast=WeightCast.TE, recipe=f"{library}, 1-D blocks of 32",
            checked_by=f"{_TORCHAO_TEST}: equal to torchao's to_mx RCEIL (which restates TE's ptx.cuh) on bf16 and "
                       f"fp16 weights; {_TE_TEST}: TE's MXFP8Quantizer on a Blackwell GPU",
            caveat="bf16/fp16 weights; for fp32 master weights TE's product amax * fp32(1/448) and torchao's "
                   "quotient amax / 448 are not compared here")
    if isinstance(scaling, AORecipeName) or hasattr(recipe, "float8_linear_recipe"):
        # Float8Linear (recipe_name) and Float8TrainingOpConfig (float8_linear_recipe) cast the weight alike
        name = getattr(recipe, "float8_linear_recipe", scaling)
        # tensorwise: one scale per tensor; rowwise (and rowwise_with_gw_hp): one per output channel
        layout = Layout.COMPRESSED_TENSORS_FP8_PER_TENSOR_DYNAMIC if name is AORecipeName.TENSORWISE \
            else Layout.COMPRESSED_TENSORS_FP8_DYNAMIC
        return TrainingTwin(layout=layout, cast=WeightCast.TORCHAO, recipe=f"{library}, {name.value}",
                            checked_by=f"{_TORCHAO_TEST}: torchao's hp_tensor_to_float8_dynamic called as "
                                       "Float8Linear.forward calls it on the weight")
    if hasattr(recipe, "scale_calculation_mode"):
        mode = recipe.scale_calculation_mode
        rounding = "rceil" if mode is MXScaleCalculationMode.RCEIL else "floor"
        return TrainingTwin(layout=Layout.MXFP8, cast=WeightCast.TORCHAO, scale_mode=rounding,
                            recipe=f"{library}, scale_calculation_mode {mode.value}",
                            checked_by=f"{_TORCHAO_TEST}: torchao's to_mx with the same ScaleCalculationMode")
    raise RequestError(f"{library} has no serving twin: its weight casts are not written by any serving format "
                       "(docs/sync.md lists the recipes that have one); pass --format with a serving format to write "
                       "an export that is not bit-identical to training", field="format")


def twin_report(recipe: Any, format_name: str) -> dict[str, Any]:
    """``training_twin`` block of a sync report: the recipe, whether ``format_name`` is its twin, how it is checked."""
    try:
        twin = training_twin(recipe)
    except RequestError:
        return {"recipe": recipe.to_dict(), "identical": False, "twin": None}
    identical = twin.format == format_name
    return {"recipe": recipe.to_dict(), "identical": identical, "twin": twin.format,
            **({"training": twin.recipe, "how_checked": twin.checked_by, "caveat": twin.caveat} if identical else {})}
