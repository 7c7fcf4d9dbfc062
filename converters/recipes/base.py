"""Names, bounds and field checks shared by every recipe class (no torch, no recipe classes here).

``converters.recipes.registry`` re-exports everything public; import from there.
"""

from __future__ import annotations

import enum
from typing import Any

from converters.errors import RecipeError

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
    "allowed",
    "coerce_enum",
    "check_int",
    "check_bool",
    "check_fp8_format",
    "brief",
]

RECIPE_VERSION = 1

# Upper bounds: a number a client sends must never let one job outgrow a worker's memory.
#: Rows of the fp32 amax history TE keeps per Linear (3 forward, 2 backward columns), in the worker, the
#: artifact and every process that loads it. Users pick 16..1024 (TE's default is 1024); 4096 leaves room and
#: keeps one Linear's history at 80 KiB. Unbounded, 2**40 made the worker try to allocate 13 TB.
MAX_AMAX_HISTORY_LEN = 4096
#: ``scale = fp8_max * 2**-margin / amax``: at 32 E4M3's range (448) has shrunk below 1e-7 already; beyond,
#: the fp32 scale only heads for underflow (2**-149 is 0). Working recipes use 0..a few.
MAX_MARGIN = 32
#: ``interval`` has no effect any more (TE removed it); bounded to the int32 step count TE kept it in.
MAX_INTERVAL = 2**31 - 1


class Backend(str, enum.Enum):
    """Conversion backend."""

    TE = "te"  #: TransformerEngine (te.Linear); runs only on a CUDA worker.
    AO = "ao"  #: torchao (Float8Linear, or a quantize_ training config).


class Fp8Format(str, enum.Enum):
    """TransformerEngine ``Format``; pure E5M2 is absent because every TE FP8 recipe rejects it."""

    HYBRID = "HYBRID"  #: E4M3 forward, E5M2 backward.
    E4M3 = "E4M3"  #: E4M3 both ways.


class AmaxComputeAlgo(str, enum.Enum):
    """How TE picks the amax from the history window."""

    MAX = "max"  #: largest amax in the window (TE's default).
    MOST_RECENT = "most_recent"  #: the current step's amax (Accelerate's default).


class TEScaling(str, enum.Enum):
    """TransformerEngine recipe: the ``scaling`` of a ``te`` recipe, one per TE recipe class."""

    DELAYED = "delayed"  #: ``DelayedScaling``: per-tensor scale from the amax history of earlier steps.
    CURRENT = "current"  #: ``Float8CurrentScaling``: stateless, per-tensor scale from the tensor being cast.
    MXFP8_BLOCK = "mxfp8_block"  #: ``MXFP8BlockScaling``: blocks of 32 values, E8M0 (power-of-two) scales.
    FLOAT8_BLOCK = "float8_block"  #: ``Float8BlockScaling``: 1x128 / 128x128 blocks, fp32 scales.
    NVFP4_BLOCK = "nvfp4_block"  #: ``NVFP4BlockScaling``: FP4 (E2M1) in blocks of 16, E4M3 scales + fp32 global.


class AORecipeName(str, enum.Enum):
    """torchao ``Float8LinearRecipeName`` values."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    ROWWISE_WITH_GW_HP = "rowwise_with_gw_hp"


class AOTrainingOp(str, enum.Enum):
    """torchao ``quantize_`` training configs (``torchao.prototype.moe_training.config``): the ``scaling`` of an
    ``ao`` recipe that is not a ``Float8Linear`` recipe."""

    FLOAT8 = "float8_training_op"  #: ``Float8TrainingOpConfig``
    MXFP8 = "mxfp8_training_op"  #: ``MXFP8TrainingOpConfig``


class NVFP4Scope(str, enum.Enum):
    """Which tensors an NVFP4 "4over6" option applies to (TE's ``_NVFP4_4OVER6_SCOPES``)."""

    NONE = "none"
    WEIGHTS = "weights"
    ACTIVATIONS = "activations"
    ALL = "all"


class NVFP4ErrMode(str, enum.Enum):
    """Error metric of NVFP4 4over6 candidate selection (TE's ``_NVFP4_4OVER6_ERR_MODES``)."""

    MAE = "MAE"
    MSE = "MSE"


class NVFP4WeightScales(str, enum.Enum):
    """How the ``nvfp4`` / ``nvfp4-a16`` serving exports choose their E4M3 weight block scales
    (:mod:`converters.serving.nvfp4`)."""

    RTN = "rtn"  #: each block's amax maps to E2M1's 6, compressed-tensors' and llm-compressor's bytes
    MSE = "mse"  #: per block, the E4M3 scale of least squared error among RTN's neighbours and the 4-scale
    FOUR_OVER_SIX = "four_over_six"  #: per block, the amax maps to 6 or to 4, whichever errs less (Cook et al.)


class NVFP4WeightRounding(str, enum.Enum):
    """How the NVFP4 serving exports (``nvfp4``, ``nvfp4-a16``, ``modelopt-nvfp4``) round each weight onto E2M1 under
    their scales (:mod:`converters.calibration.gptq_rounding`)."""

    NEAREST = "nearest"  #: each value to its nearest code, on its own
    #: GPTQ: columns in order of decreasing input energy, each one's output error fed to the columns not yet rounded,
    #: with each decoder layer's inputs from the earlier layers as already rounded (the calibration's layer walk)
    GPTQ = "gptq"


class NVFP4Smoothing(str, enum.Enum):
    """Whether the job smooths its source before an NVFP4 W4A4 export (``nvfp4``, ``modelopt-nvfp4``):
    per-input-channel scales folded into what feeds each decoder Linear group
    (:mod:`converters.calibration.smoothing_walk`)."""

    NONE = "none"  #: the source as it is
    #: AWQ's ratio search, each candidate scored by the group's W4A4 output error on the calibration inputs
    AWQ = "awq"


class MXKernelPreference(str, enum.Enum):
    """torchao ``KernelPreference`` values ``MXFP8TrainingOpConfig`` documents for training."""

    AUTO = "auto"  #: torchao's CUDA/Triton casts and MXFP8 GEMMs (Blackwell).
    EMULATED = "emulated"  #: dequantize and multiply in high precision: any device, for checks only.


class MXScaleCalculationMode(str, enum.Enum):
    """torchao ``ScaleCalculationMode`` values its MXFP8 training casts accept (``triton_to_mxfp8_dim0``)."""

    RCEIL = "rceil"
    FLOOR = "floor"


def allowed(enum_cls: type[enum.Enum]) -> str:
    """The values of ``enum_cls``, comma separated (for messages)."""
    return ", ".join(str(m.value) for m in enum_cls)


def brief(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters: an error names the value it refuses, never a megabyte of it."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit cannot even be printed
        return f"<{type(value).__name__} too large to show>"
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def coerce_enum(value: Any, enum_cls: type[enum.Enum], field: str, *, upper: bool) -> Any:
    """``value`` as a member of ``enum_cls`` (strings case-insensitive); RecipeError naming ``field`` otherwise."""
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        key = value.strip().upper() if upper else value.strip().lower()
        for member in enum_cls:
            if member.value == key:
                return member
    raise RecipeError(
        f"{field} must be one of {allowed(enum_cls)} (case-insensitive), got {brief(value)}.", field=field
    )


def check_int(value: Any, field: str, *, minimum: int, maximum: int, optional: bool = False) -> None:
    """Raise RecipeError naming ``field`` unless ``value`` is an int in ``[minimum, maximum]`` (or None if optional)."""
    if value is None and optional:
        return
    # bool is an int subclass; `margin: true` in a YAML file is a mistake, not 1.
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        kind = f"an integer >= {minimum} and <= {maximum}" + (" or null" if optional else "")
        raise RecipeError(f"{field} must be {kind}, got {brief(value)}.", field=field)


def check_bool(value: Any, field: str) -> None:
    """Raise RecipeError naming ``field`` unless ``value`` is a bool."""
    if not isinstance(value, bool):
        raise RecipeError(f"{field} must be true or false, got {brief(value)}.", field=field)


def check_fp8_format(value: Any, field: str = "fp8_format") -> Fp8Format:
    """``value`` as an :class:`Fp8Format`; E5M2 gets its own message (TE asserts "Pure E5M2 training is not
    supported" in every FP8 recipe's ``__post_init__``)."""
    if isinstance(value, str) and value.strip().upper() == "E5M2":
        raise RecipeError(
            f"{field} E5M2 is rejected by TransformerEngine (pure E5M2 training is not supported); "
            f"use one of {allowed(Fp8Format)}.",
            field=field,
        )
    return coerce_enum(value, Fp8Format, field, upper=True)
