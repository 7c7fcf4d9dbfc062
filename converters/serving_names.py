"""The serving formats by name, without torch: each one's layout, whose arithmetic casts its weights, and what it
needs. The request check, the API schema, the CLI's help and the sync twin table read them from here; the format
objects themselves (:data:`converters.serving.SERVING_FORMATS`, which imports torch) are held equal to this table
by the tests.

A format is a layout (the tensors and ``quantization_config`` an engine reads) and a weight cast (whose rounding
writes the values). The serving cast is the quantizer the layout comes from; a training cast writes, bit for bit,
the weights a training recipe's forward casts, so that export is that recipe's training twin
(:mod:`converters.sync.twins` picks it from the recipe by layout and cast).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from converters.errors import RequestError

__all__ = [
    "KV_CACHE_FORMAT_NAMES",
    "Layout",
    "SERVING_FORMAT_NAMES",
    "SERVING_FORMAT_SPECS",
    "ServingFormatSpec",
    "UNCALIBRATED_FORMAT_NAMES",
    "WeightCast",
    "format_spec",
    "training_twin_name",
]


class WeightCast(str, enum.Enum):
    """Whose arithmetic turns a high-precision weight into the stored FP8 values and scales."""

    SERVING = "serving"  #: the layout's own quantizer: llm-compressor, transformers' FP8 integration, ModelOpt
    TE = "te"  #: TransformerEngine's training cast (Float8BlockScaling, MXFP8BlockScaling, Float8CurrentScaling)
    TORCHAO = "torchao"  #: torchao's training cast (Float8Linear, Float8TrainingOpConfig, MXFP8 training)


class Layout(str, enum.Enum):
    """The tensors and ``quantization_config`` of an export: what an engine reads (one row of
    :mod:`converters.serving.loads_in`)."""

    COMPRESSED_TENSORS_FP8 = "compressed-tensors-fp8"  #: per-tensor weight and static input scales
    COMPRESSED_TENSORS_FP8_DYNAMIC = "compressed-tensors-fp8-dynamic"  #: per-channel weight, per-token inputs
    #: per-tensor weight scale, inputs quantized per token at run time
    COMPRESSED_TENSORS_FP8_PER_TENSOR_DYNAMIC = "compressed-tensors-fp8-per-tensor-dynamic"
    FP8_BLOCK = "fp8-block"  #: transformers ``fp8``, 128x128 weight blocks, fp32 scales
    FP8_BLOCK_UE8M0 = "fp8-block-ue8m0"  #: the same with power-of-two scales (``scale_fmt: ue8m0``)
    MXFP8 = "mxfp8"  #: compressed-tensors ``mxfp8-quantized``
    NVFP4 = "nvfp4"
    NVFP4_A16 = "nvfp4-a16"
    MODELOPT_FP8 = "modelopt-fp8"
    MODELOPT_NVFP4 = "modelopt-nvfp4"


@dataclass(frozen=True, kw_only=True)
class ServingFormatSpec:
    """One serving format: the name users pass, its layout and weight cast, and what it needs."""

    name: str
    layout: Layout
    cast: WeightCast = WeightCast.SERVING
    #: the training library's scale rounding, where one library writes one layout two ways (torchao MXFP8's
    #: ``scale_calculation_mode``: ``rceil``, ``floor``); None elsewhere
    scale_mode: str | None = None
    calibrated: bool = False  #: stores static input scales, so only a calibrated conversion writes it
    kv_cache: bool = False  #: can carry FP8 KV-cache scales from the job's calibration

    @property
    def training_twin(self) -> bool:
        """Whether it writes a training library's own weight casts (docs/sync.md)."""
        return self.cast is not WeightCast.SERVING


_L, _TE, _AO = Layout, WeightCast.TE, WeightCast.TORCHAO
#: In the registry's order, which is the order of every list users see (API enum, CLI help, error messages).
SERVING_FORMAT_SPECS: tuple[ServingFormatSpec, ...] = (
    ServingFormatSpec(name="compressed-tensors-fp8", layout=_L.COMPRESSED_TENSORS_FP8, calibrated=True, kv_cache=True),
    ServingFormatSpec(name="compressed-tensors-fp8-dynamic", layout=_L.COMPRESSED_TENSORS_FP8_DYNAMIC, kv_cache=True),
    ServingFormatSpec(name="fp8-block", layout=_L.FP8_BLOCK),
    ServingFormatSpec(name="fp8-block-ue8m0", layout=_L.FP8_BLOCK_UE8M0),
    ServingFormatSpec(name="mxfp8", layout=_L.MXFP8),
    ServingFormatSpec(name="nvfp4", layout=_L.NVFP4, calibrated=True),
    ServingFormatSpec(name="nvfp4-a16", layout=_L.NVFP4_A16),
    ServingFormatSpec(name="modelopt-fp8", layout=_L.MODELOPT_FP8, calibrated=True, kv_cache=True),
    ServingFormatSpec(name="modelopt-nvfp4", layout=_L.MODELOPT_NVFP4, calibrated=True, kv_cache=True),
    ServingFormatSpec(name="fp8-block-te", layout=_L.FP8_BLOCK, cast=_TE),
    ServingFormatSpec(name="fp8-block-ue8m0-te", layout=_L.FP8_BLOCK_UE8M0, cast=_TE),
    ServingFormatSpec(name="mxfp8-te", layout=_L.MXFP8, cast=_TE),
    ServingFormatSpec(name="mxfp8-rceil", layout=_L.MXFP8, cast=_AO, scale_mode="rceil"),
    ServingFormatSpec(name="mxfp8-floor", layout=_L.MXFP8, cast=_AO, scale_mode="floor"),
    ServingFormatSpec(name="compressed-tensors-fp8-torchao-tensorwise",
                      layout=_L.COMPRESSED_TENSORS_FP8_PER_TENSOR_DYNAMIC, cast=_AO),
    ServingFormatSpec(name="compressed-tensors-fp8-torchao-rowwise", layout=_L.COMPRESSED_TENSORS_FP8_DYNAMIC,
                      cast=_AO),
    ServingFormatSpec(name="compressed-tensors-fp8-te-tensorwise", layout=_L.COMPRESSED_TENSORS_FP8_PER_TENSOR_DYNAMIC,
                      cast=_TE),
)
_BY_NAME = {spec.name: spec for spec in SERVING_FORMAT_SPECS}
_BY_CAST = {(spec.layout, spec.cast, spec.scale_mode): spec.name for spec in SERVING_FORMAT_SPECS}
if len(_BY_NAME) != len(SERVING_FORMAT_SPECS) or len(_BY_CAST) != len(SERVING_FORMAT_SPECS):
    raise RuntimeError("two serving formats share a name, or a layout, cast and scale mode")  # an edit above is wrong

SERVING_FORMAT_NAMES = tuple(_BY_NAME)
#: the formats that write KV-cache scales (``supports_kv_cache`` of the format objects; tests keep the two equal)
KV_CACHE_FORMAT_NAMES = tuple(spec.name for spec in SERVING_FORMAT_SPECS if spec.kv_cache)
#: the formats a conversion without calibration writes (model-free requantize, sync): dynamic or no activations
UNCALIBRATED_FORMAT_NAMES = tuple(spec.name for spec in SERVING_FORMAT_SPECS if not spec.calibrated)


def format_spec(name: str, *, field: str = "format") -> ServingFormatSpec:
    """The format called ``name``.

    Raises:
        RequestError: naming ``field`` and the known names, when no format is called ``name``.
    """
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise RequestError(f"unknown serving format {name!r}; known: {', '.join(SERVING_FORMAT_NAMES)}",
                           field=field) from None


def training_twin_name(layout: Layout, cast: WeightCast, scale_mode: str | None = None) -> str:
    """The name of the format writing ``layout`` with ``cast`` (and ``scale_mode``, where the cast has two).

    Raises:
        LookupError: no format writes that layout with that cast (a programming error: the callers ask only for
            the pairs :mod:`converters.sync.twins` documents).
    """
    try:
        return _BY_CAST[(Layout(layout), WeightCast(cast), scale_mode)]
    except KeyError:
        raise LookupError(f"no serving format writes {Layout(layout).value} with the {WeightCast(cast).value} cast"
                          + (f" ({scale_mode})" if scale_mode else "")) from None
