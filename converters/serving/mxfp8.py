"""compressed-tensors MXFP8 (W8A8 MX): the ``mxfp8-quantized`` checkpoint of llm-compressor's ``MXFP8`` preset.

Layout (compressed-tensors 0.20.1, ``compressors/mxfp8/base.py``, ``quantization/quant_scheme.py`` ``MXFP8``):
per quantized Linear ``weight`` F8_E4M3 ``[out, in]`` and ``weight_scale`` U8 ``[out, in/32]``, the biased E8M0
exponent of each 32-element group along ``in_features``: ``w ~= weight * 2**(weight_scale - 127)`` per group.
Activations are quantized at run time to MXFP8 (``strategy group, group_size 32, dynamic true``), so no
calibration is needed. ``quantization_config``: ``format`` and the group's ``format`` ``mxfp8-quantized``, weights
and inputs ``num_bits 8, type float, symmetric, strategy group, group_size 32, scale_dtype "torch.uint8"``, as
compressed-tensors' own ``QuantizationConfig`` dumps them.

Arithmetic (compressed-tensors 0.20.1 ``calculate_qparams`` -> ``generate_mx_scales`` / ``round_to_power_2``
in ``quantization/utils/mxfp_utils.py``, ``quantize`` in ``lifecycle/forward_helpers.py``, ``compress_mx_scale``
in ``compressors/mx_utils.py``), all in the model's dtype: the group amax is rounded to a power of two, up when
its mantissa is at least 0.75 (bit trick with the E2M1 mantissa width, the rule compressed-tensors applies to
every MX width but FP6), so the exponent is ``floor(log2(amax)) - 8`` plus one when ``amax >= 1.75 * 2**k``:
the smallest power of two with ``amax / scale <= 448`` but at ``amax = 1.75 * 2**k`` exactly, where it takes the
next one. That is neither TE's RCEIL nor OCP's FLOOR (:func:`converters.casts.emulation.e8m0_exponent`),
hence its own code here; the weights and scales are bit-identical to compressed-tensors' (tested against its
functions on the same weight). A zero group gets exponent 0 (2**-127 in bf16 and fp32).

Eligibility: ``in_features % 32 == 0`` (one scale per 32 inputs; compressed-tensors' ``_process_group``
refuses anything else), reason ``dim_not_divisible_by_32_for_mxfp8``. ``out_features`` needs no rule of its own:
vLLM's ``CompressedTensorsW8A8Mxfp8`` (``schemes/compressed_tensors_w8a8_mxfp8.py`` and ``utils/mxfp8_utils.py``
at vllm-project/vllm d2f5a056) creates ``weight_scale`` ``[out, in/32]`` and pads rows to 128 itself when it
swizzles the scales; the analysis' multiple-of-16 rule still applies. vLLM reads the checkpoint with
``CompressedTensorsMxfp8`` (FlashInfer CUTLASS on SM100+, Marlin W8A16 on SM80+); not run here (no GPU).

Training twins (:class:`MXScaleMode`, :func:`mx_exponents`): ``mxfp8-te`` (TE ``MXFP8BlockScaling``),
``mxfp8-rceil`` and ``mxfp8-floor`` (torchao's ``to_mx``, the cast of its MXFP8 training configs) write this layout
with the training library's own exponent choice and scaling, read from the weight as stored (bf16 or fp32).

MoE experts: each on-disk expert matrix is quantized as a weight of its own under its own name, with the 32 rule
applied per matrix; no engine was checked on an MXFP8 MoE export.
"""

from __future__ import annotations

import enum
import functools
from typing import Any

import torch

from converters.analysis.reasons import Reason
from converters.casts.elements import divide_exactly
from converters.casts.emulation import E4M3_MAX, max_abs, quotient_to_e4m3
from converters.model.safetensors_stream import SourceTensor, planned_entry
from converters.serving.compressed_tensors import ignore_list
from converters.serving.e4m3_cast import to_e4m3
from converters.serving.selection import ServingSelection

__all__ = ["GROUP", "MXFP8", "MXFP8_FLOOR", "MXFP8_RCEIL", "MXFP8_TE", "MXFP8Format", "MXScaleMode", "mx_scale",
           "mx_exponents"]

GROUP = 32
_E8M0_BIAS = 127
_E4M3_EMAX = 8  # floor(log2(448)): compressed-tensors' _MX_ELEM_OFFSET[8]
_E2M1_MANTISSA = 1  # the mantissa width compressed-tensors rounds MXFP8 amax with (FP4's, see the docstring)


def _round_to_power_2(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``round_to_power_2(amax, 1)``: add a quarter of the mantissa range, clear the mantissa."""
    info = torch.finfo(amax.dtype)
    mantissa = round(-torch.log2(torch.tensor(info.eps, dtype=torch.float64)).item())
    exponent = info.bits - 1 - mantissa
    bits = amax.view(torch.int16).to(torch.int32) & 0xFFFF if info.bits == 16 else amax.view(torch.int32)
    rounded = (bits + (1 << (mantissa - _E2M1_MANTISSA - 1))) & (((1 << (exponent + 1)) - 1) << mantissa)
    return rounded.to(torch.int16).view(amax.dtype) if info.bits == 16 else rounded.view(amax.dtype)


def mx_scale(amax: torch.Tensor) -> torch.Tensor:
    """The power-of-two dequantization scale of each group with this amax, in amax's dtype (compressed-tensors').

    ``amax`` is bf16, fp16 or fp32. Raises TypeError for another dtype.
    """
    _check_scale_dtype(amax.dtype)
    return _mx_scales(amax)[0]


def _check_scale_dtype(dtype: torch.dtype) -> None:
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"MXFP8 scales are computed in bf16, fp16 or fp32, got {dtype}")


def _mx_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(mx_scale(amax), its biased E8M0 byte)``, read from a table per dtype.

    compressed-tensors' scale depends on amax only through ``round_to_power_2(amax)``, whose mantissa bits are
    cleared: its sign and exponent bits (512 values for bf16 and fp32, 64 for fp16) index a table of what
    :func:`_mx_scale_reference` and the byte's formula give for that rounded value itself (rounding it again
    leaves it as it is). Three integer ops and two gathers over the groups' amax, where the formula takes about
    twenty ops (powers, logarithms, conversions); the same values (tested over every 16-bit pattern).
    """
    scale_table, byte_table, mantissa, increment, mask = _mx_tables(amax.dtype)
    bits = amax.view(torch.int16).to(torch.int32) & 0xFFFF if amax.element_size() == 2 else amax.view(torch.int32)
    index = ((bits + increment) & mask) >> mantissa  # the reference's rounding, its mantissa bits dropped
    index = index.bitwise_and_(mask >> mantissa).reshape(-1)  # fp32: the sign bit the arithmetic shift spread
    scale_table, byte_table = scale_table.to(amax.device), byte_table.to(amax.device)
    return (torch.index_select(scale_table, 0, index).view(amax.shape),
            torch.index_select(byte_table, 0, index).view(amax.shape))


@functools.cache
def _mx_tables(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """``(scales, bytes, mantissa bits, rounding increment, sign-and-exponent mask)`` of :func:`_mx_scales`."""
    info = torch.finfo(dtype)
    mantissa = round(-torch.log2(torch.tensor(info.eps, dtype=torch.float64)).item())
    exponent = info.bits - 1 - mantissa
    classes = torch.arange(1 << (exponent + 1), dtype=torch.int64) << mantissa  # each rounded value's bits
    if info.bits == 16:
        values = classes.to(torch.int32).to(torch.int16).view(dtype)  # (wraps into the sign bit, as int16 holds it)
    else:
        values = classes.to(torch.int32).view(dtype)
    scales = _mx_scale_reference(values)
    return (scales, _e8m0_byte(scales), mantissa, 1 << (mantissa - _E2M1_MANTISSA - 1),
            ((1 << (exponent + 1)) - 1) << mantissa)


def _e8m0_byte(scale: torch.Tensor) -> torch.Tensor:
    """The biased E8M0 byte compressed-tensors stores for a power-of-two ``scale`` (``compress_mx_scale``)."""
    return (_E8M0_BIAS + torch.floor(torch.log2(scale)).to(torch.int32)).to(torch.uint8)


def _mx_scale_reference(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``generate_mx_scales`` element by element (what :func:`mx_scale` reads from a table)."""
    _check_scale_dtype(amax.dtype)
    biased = _E8M0_BIAS + torch.floor(torch.log2(_round_to_power_2(amax))) - _E4M3_EMAX
    biased = torch.round(biased.clamp(0, 255)).to(torch.uint8).to(amax.dtype)
    scale = (2.00 ** (biased.to(torch.int32) - _E8M0_BIAS).to(torch.float)).to(amax.dtype)
    return torch.where(scale == 0, torch.ones_like(scale), scale)  # the uint8 scale dtype's eps is 1


class MXScaleMode(str, enum.Enum):
    """How a group's E8M0 exponent is chosen and its values scaled (same layout, other bits).

    ``compressed-tensors``: llm-compressor's rounding (:func:`mx_scale`). ``transformer-engine``: TE's
    ``MXFP8BlockScaling`` cast. ``rceil`` / ``floor``: torchao's ``to_mx`` with that ``ScaleCalculationMode``
    (the MXFP8 training configs' casts). See :func:`mx_exponents`.
    """

    COMPRESSED_TENSORS = "compressed-tensors"
    TRANSFORMER_ENGINE = "transformer-engine"
    RCEIL = "rceil"
    FLOOR = "floor"


_RCP_448 = torch.tensor(1 / E4M3_MAX, dtype=torch.float32)  # TE's Quantized_Limits<fp8e4m3>::max_norm_rcp
_F32_MIN_NORMAL = 2.0 ** -126


def mx_exponents(groups: torch.Tensor, mode: MXScaleMode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(biased E8M0 exponent uint8, E4M3 values)`` of ``groups`` ``[..., n, 32]`` under a training library's mode.

    * ``transformer-engine`` (``common/cast/mxfp8/quantize_mxfp8.cuh``, ``util/ptx_arch_spec.cuh``
      ``float_to_e8m0``, ``util/ptx.cuh`` ``exp2f_rcp``): ``amax * fp32(1/448)`` rounded up to a power of two
      (a value at most 2**-127 gets exponent 0), values multiplied by ``2**(127 - e)`` (2**127 for e = 0). TE's
      specialized cast-only kernel for bf16/fp16 inputs (``cast/mxfp8/specialized/quantize_mxfp8.cuh``) multiplies
      by the 16-bit ``1/448`` instead (0.2% / 0.03% low): an exponent one lower for an amax in that band above
      ``448 * 2**k``, where no bf16 or fp16 value lies, so both kernels give 16-bit weights the same exponents.
    * ``rceil`` (torchao ``_to_mx_rceil``): ``ceil(log2(amax / 448))`` clamped to [-127, 127] in fp32; values
      multiplied by ``2**(127 - e)``, by 1 for e = 0.
    * ``floor`` (torchao ``to_mx``): the amax's own exponent minus 8, clamped to [-127, 128]; values divided by
      the scale, itself at least 2**-126.

    Values are clamped to +-448 and rounded to nearest even, as both libraries' saturating casts do.
    """
    amax = max_abs(groups, dim=-1).float()  # |w| and its max in the weight's dtype: exact there
    if mode is MXScaleMode.TRANSFORMER_ENGINE:
        product = amax * _RCP_448
        bits = product.view(torch.int32)
        exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
        up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
        biased = exponent + up.to(exponent.dtype)
        biased = torch.where(torch.isinf(product), 0xFE, torch.where(torch.isnan(product), 0xFF, biased))
        multiplier = torch.where(biased == 254, torch.tensor(2.0 ** -127),
                                 ((254 - biased) << 23).view(torch.float32))
        quantized = to_e4m3(groups, multiplier, power_of_two=True)
    elif mode is MXScaleMode.RCEIL:
        biased = (torch.clamp(torch.ceil(torch.log2(divide_exactly(amax, E4M3_MAX))), min=-_E8M0_BIAS, max=_E8M0_BIAS)
                  + _E8M0_BIAS).to(torch.uint8)
        multiplier = torch.where(biased == 254, 2.0 ** -127, torch.where(
            biased == 0, 1.0, torch.exp2(_E8M0_BIAS - biased.to(torch.float32))))
        quantized = to_e4m3(groups, multiplier, power_of_two=True)
    elif mode is MXScaleMode.FLOOR:
        own = ((amax.view(torch.int32) >> 23) & 0xFF) - _E8M0_BIAS
        biased = (torch.clamp(own - _E4M3_EMAX, min=-_E8M0_BIAS, max=_E8M0_BIAS + 1) + _E8M0_BIAS).to(torch.uint8)
        scale = torch.clamp((biased.to(torch.int32) << 23).view(torch.float32), min=_F32_MIN_NORMAL)
        quantized = to_e4m3(groups, scale, divide=True, power_of_two=True)
    else:
        raise ValueError(f"mx_exponents has no arithmetic for mode {mode.value}: use mx_scale")
    return biased.to(torch.uint8).squeeze(-1), quantized


class MXFP8Format:
    """compressed-tensors MXFP8: E4M3 weights in groups of 32 inputs with E8M0 scales, dynamic MX activations.

    ``mode`` chooses whose arithmetic writes the bits (:class:`MXScaleMode`); the checkpoint reads the same.
    """

    needs_calibration = False
    weight_cast = "mxfp8_e4m3_block32"  #: the emulated cast of the report's weight SQNR (ServingSelection.layer_stats)
    input_cast = "mxfp8_e4m3_block32"  #: and of the input, in the calibration's SQNR under this format

    def __init__(self, *, name: str = "mxfp8", mode: MXScaleMode = MXScaleMode.COMPRESSED_TENSORS) -> None:
        self.name = name
        self.mode = MXScaleMode(mode)
        #: strips of 4x converters.rewrite.strips.STRIP_ELEMENTS where the cast's temporaries are in the model's
        #: dtype (compressed-tensors' arithmetic); the training twins compute in fp32
        self.strip_factor = 4 if self.mode is MXScaleMode.COMPRESSED_TENSORS else 1

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        """The reason a Linear of this shape stays in high precision, or None."""
        return None if in_features % GROUP == 0 else Reason.DIM_NOT_DIVISIBLE_MXFP8.value

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        rows, columns = weight.shape
        return {
            weight_key: planned_entry(torch.float8_e4m3fn, weight.shape),
            f"{weight_key.removesuffix('weight')}weight_scale": planned_entry(torch.uint8,
                                                                                     (rows, columns // GROUP)),
        }

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype
                 ) -> list[torch.Tensor]:
        if self.mode is not MXScaleMode.COMPRESSED_TENSORS:
            # the training casts read the weight as stored (bf16 or fp32 master weights), not the model's dtype
            exponent, quantized = mx_exponents(weight.unflatten(-1, (weight.shape[-1] // GROUP, GROUP)), self.mode)
            return [quantized.flatten(-2), exponent]
        # In the model's dtype, as compressed-tensors runs it: the scale is a power of two, so the division is exact.
        groups = weight.to(scale_dtype).unflatten(-1, (weight.shape[-1] // GROUP, GROUP))
        _check_scale_dtype(groups.dtype)
        amax = max_abs(groups, dim=-1, keepdim=False)
        scale, exponent = _mx_scales(amax)
        # + 0: llm-compressor adds the symmetric scheme's zero point (0), which turns a -0 weight into +0; in place on
        # the fresh quotient. Its clamp to +-448 only where a quotient could cast otherwise without it
        # (e4m3_clamp_needed): the scale is a power of two with amax / scale <= 448, but at a NaN amax.
        quotient = (groups / scale.unsqueeze(-1)).add_(0)
        return [quotient_to_e4m3(quotient, amax, scale).flatten(-2), exponent]

    def quantization_config(self, selection: ServingSelection) -> dict[str, Any]:
        def args(*, dynamic: bool) -> dict[str, Any]:
            return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": GROUP, "strategy": "group",
                    "dynamic": dynamic, "scale_dtype": "torch.uint8"}

        return {
            "quant_method": "compressed-tensors",
            "format": "mxfp8-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": args(dynamic=False),
                                          "input_activations": args(dynamic=True), "output_activations": None,
                                          "format": "mxfp8-quantized"}},
            "ignore": ignore_list(selection),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "transform_config": {},
        }


MXFP8 = MXFP8Format()
#: the training twins: TE ``MXFP8BlockScaling``, torchao MXFP8 with RCEIL and with FLOOR scales
MXFP8_TE = MXFP8Format(name="mxfp8-te", mode=MXScaleMode.TRANSFORMER_ENGINE)
MXFP8_RCEIL = MXFP8Format(name="mxfp8-rceil", mode=MXScaleMode.RCEIL)
MXFP8_FLOOR = MXFP8Format(name="mxfp8-floor", mode=MXScaleMode.FLOOR)
