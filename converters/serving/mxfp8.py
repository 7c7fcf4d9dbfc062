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
next one. That is neither TE's RCEIL nor OCP's FLOOR (:func:`converters.calibration.emulation.e8m0_exponent`),
hence its own code here; the weights and scales are bit-identical to compressed-tensors' (tested against its
functions on the same weight). A zero group gets exponent 0 (2**-127 in bf16 and fp32).

Eligibility: ``in_features % 32 == 0`` (one scale per 32 inputs; compressed-tensors' ``_process_group``
refuses anything else), reason ``dim_not_divisible_by_32_for_mxfp8``. ``out_features`` needs no rule of its own:
vLLM's ``CompressedTensorsW8A8Mxfp8`` (``schemes/compressed_tensors_w8a8_mxfp8.py`` and ``utils/mxfp8_utils.py``
at vllm-project/vllm d2f5a056) creates ``weight_scale`` ``[out, in/32]`` and pads rows to 128 itself when it
swizzles the scales; the analysis' multiple-of-16 rule still applies. vLLM reads the checkpoint with
``CompressedTensorsMxfp8`` (FlashInfer CUTLASS on SM100+, Marlin W8A16 on SM80+); not run here (no GPU).

MoE experts: each on-disk expert matrix is quantized as a weight of its own under its own name, with the 32 rule
applied per matrix; no engine was checked on an MXFP8 MoE export.
"""

from __future__ import annotations

from typing import Any

import torch

from converters.analysis.reasons import Reason
from converters.calibration.emulation import E4M3_MAX
from converters.model.safetensors_stream import SourceTensor, StreamingWriter
from converters.serving.compressed_tensors import ignore_list
from converters.serving.plan import ServingPlan

__all__ = ["GROUP", "MXFP8", "MXFP8Format", "mx_scale"]

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
    if amax.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"MXFP8 scales are computed in bf16, fp16 or fp32, got {amax.dtype}")
    biased = _E8M0_BIAS + torch.floor(torch.log2(_round_to_power_2(amax))) - _E4M3_EMAX
    biased = torch.round(biased.clamp(0, 255)).to(torch.uint8).to(amax.dtype)
    scale = (2.00 ** (biased.to(torch.int32) - _E8M0_BIAS).to(torch.float)).to(amax.dtype)
    return torch.where(scale == 0, torch.ones_like(scale), scale)  # the uint8 scale dtype's eps is 1


class MXFP8Format:
    """compressed-tensors MXFP8: E4M3 weights in groups of 32 inputs with E8M0 scales, dynamic MX activations."""

    name = "mxfp8"
    needs_calibration = False
    weight_cast = "mxfp8_e4m3_block32"  #: the emulated cast of the report's weight SQNR (plan.layer_stats)
    input_cast = "mxfp8_e4m3_block32"  #: and of the input, in the calibration's SQNR under this format

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        """The reason a Linear of this shape stays in high precision, or None."""
        return None if in_features % GROUP == 0 else Reason.DIM_NOT_DIVISIBLE_MXFP8.value

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        rows, columns = weight.shape
        return {
            weight_key: StreamingWriter.entry(torch.float8_e4m3fn, weight.shape),
            f"{weight_key.removesuffix('weight')}weight_scale": StreamingWriter.entry(torch.uint8,
                                                                                     (rows, columns // GROUP)),
        }

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype
                 ) -> list[torch.Tensor]:
        # In the model's dtype, as compressed-tensors runs it: the scale is a power of two, so the division is exact.
        groups = weight.to(scale_dtype).unflatten(-1, (weight.shape[-1] // GROUP, GROUP))
        scale = mx_scale(groups.abs().amax(dim=-1))
        # + 0: llm-compressor adds the symmetric scheme's zero point (0), which turns a -0 weight into +0
        quantized = (groups / scale.unsqueeze(-1) + 0).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        exponent = (_E8M0_BIAS + torch.floor(torch.log2(scale)).to(torch.int32)).to(torch.uint8)
        return [quantized.flatten(-2), exponent]

    def quantization_config(self, plan: ServingPlan) -> dict[str, Any]:
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
            "ignore": ignore_list(plan),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "transform_config": {},
        }


MXFP8 = MXFP8Format()
