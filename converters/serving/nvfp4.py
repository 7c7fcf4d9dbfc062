"""compressed-tensors ``nvfp4-pack-quantized``: NVFP4 as llm-compressor writes it and vLLM loads it.

Two schemes, named as llm-compressor's presets name them:

- ``NVFP4`` (W4A4): weights FP4 E2M1 in 16-element blocks along ``in_features``; activations FP4 with a
  static global scale (``input_global_scale``, from the calibrated input amax) and E4M3 scales computed per
  16-element block at run time (``dynamic: "local"``).
- ``NVFP4A16``: the same weights, activations kept in the model's dtype (no calibration needed).

Per quantized Linear: ``weight_packed`` U8 ``[out, in/2]`` (two E2M1 codes a byte, the even column in the low
nibble; code = sign bit 3 | index into 0, 0.5, 1, 1.5, 2, 3, 4, 6), ``weight_scale`` F8_E4M3 ``[out, in/16]``,
``weight_global_scale`` F32 ``[1]`` and, for W4A4, ``input_global_scale`` F32 ``[1]``. A weight dequantizes as
``code * weight_scale / weight_global_scale``.

The arithmetic is compressed-tensors 0.20.1's own, as llm-compressor's observers feed it the weight in the
model's dtype, and the bytes are identical (tests compare them with its functions):
``generate_gparam``: ``global = fp32(2688 / max(amax, tiny))`` computed in the model's dtype (NaN/inf -> 1);
``calculate_qparams``: ``scale = e4m3(global * (block_amax / 6))`` (``block_amax / 6`` in the model's dtype,
the product in fp32), a zero scale becomes 0.125 (E4M3's eps); ``quantize``: ``x / (scale / global)`` in fp32,
clamped to +-6 and rounded to nearest even onto E2M1 (:func:`~converters.calibration.emulation.round_to_e2m1`
rounds the ties as ``cast_to_fp4`` does); ``pack_fp4_to_uint8``: the sign bit set for a negative scaled value
(one that rounds to zero is code 8, -0; a weight of -0.0 is code 0, as ``cast_to_fp4``'s ``sign(x) * |q|`` gives).

Fused groups (q/k/v, gate/up) and an expert's gate and up matrices share one ``weight_global_scale`` (from the
group's largest ``|w|``: vLLM requires it, and llm-compressor's ``update_fused_layer_weight_global_scales``
does the same), hence ``needs_weight_amax``; they share ``input_global_scale`` through the shared input amax.
MoE experts: each on-disk expert matrix is quantized under its own name, as in
:mod:`converters.serving.compressed_tensors` (w1 and w3 of one expert share their unit's global scales);
transformers reports the experts' ``input_global_scale`` as unexpected keys and drops them, vLLM reads them.

Eligibility: ``in_features`` must be a multiple of 16 (whole blocks; vLLM's NVFP4 linear methods refuse other
shapes). The analysis rule already requires both dims to be multiples of 16, so this rule only refuses what
a report from another rule would let through; its reason is ``in_features_not_divisible_by_16_for_nvfp4``.
"""

from __future__ import annotations

from typing import Any

import torch

from converters.analysis.reasons import Reason
from converters.calibration.emulation import E2M1_GRID, E2M1_MAX, E4M3_MAX, round_to_e2m1
from converters.model.safetensors_stream import SourceTensor, StreamingWriter
from converters.serving.compressed_tensors import ignore_list
from converters.serving.plan import ServingPlan

__all__ = ["GROUP", "NVFP4", "NVFP4_A16", "CompressedTensorsNVFP4", "nvfp4_rule", "pack_e2m1"]

GROUP = 16
FORMAT = "nvfp4-pack-quantized"
_E4M3_EPS = 0.125  # compressed-tensors' _get_dtype_eps(float8_e4m3fn)
# |code value| * 2 for the magnitude codes 0..7, to find a code by exact match
_DOUBLED_GRID = torch.tensor([2 * value for value in E2M1_GRID])


def nvfp4_rule(in_features: int, out_features: int) -> str | None:
    """The reason a Linear of this shape cannot be stored in 16-element FP4 blocks, or None."""
    return None if in_features % GROUP == 0 else Reason.SERVING_NVFP4.value


def pack_e2m1(values: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """E2M1 values (``[rows, cols]``, on the grid) packed two a byte, the even column in the low nibble.

    ``negative`` says which codes carry the sign bit (engines read code 8 as -0).
    """
    magnitude = torch.searchsorted(_DOUBLED_GRID, values.abs().float() * 2).to(torch.uint8)
    codes = magnitude | (negative.to(torch.uint8) << 3)
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``generate_gparam``: ``448 * 6 / amax`` in amax's dtype, as fp32 ``[1]``."""
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    scale = torch.nan_to_num(E4M3_MAX * E2M1_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.to(torch.float32).reshape(1)


def quantize_nvfp4(weight: torch.Tensor, weight_amax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` (``[out, in]``, in the model's dtype) as (packed, E4M3 block scales, fp32 global scale)."""
    rows, columns = weight.shape
    scale_global = global_scale(torch.tensor([weight_amax], dtype=weight.dtype))
    blocks = weight.unflatten(-1, (columns // GROUP, GROUP))
    block_amax = blocks.abs().amax(dim=-1)
    scale = scale_global * (block_amax / torch.tensor(E2M1_MAX, dtype=weight.dtype))
    scale = scale.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    scale = torch.where(scale == 0, torch.tensor(_E4M3_EPS), scale)
    scaled = (blocks / (scale / scale_global).unsqueeze(-1)).reshape(rows, columns)
    values = round_to_e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX))
    return pack_e2m1(values, scaled < 0), scale.to(torch.float8_e4m3fn), scale_global


class CompressedTensorsNVFP4:
    """One compressed-tensors NVFP4 scheme (see the module docstring)."""

    needs_weight_amax = True

    def __init__(self, *, name: str, activations: bool) -> None:
        self.name = name
        self.activations = activations
        self.needs_calibration = activations
        self.weight_cast = "nvfp4_block16"  #: the emulated cast of the report's weight SQNR (plan.layer_stats)
        self.input_cast = "nvfp4_block16" if activations else None  #: and of the input (None: high precision)

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        return nvfp4_rule(in_features, out_features)

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        prefix = weight_key.removesuffix("weight")
        rows, columns = weight.shape
        entries = {
            f"{prefix}weight_packed": StreamingWriter.entry(torch.uint8, (rows, columns // 2)),
            f"{prefix}weight_scale": StreamingWriter.entry(torch.float8_e4m3fn, (rows, columns // GROUP)),
            f"{prefix}weight_global_scale": StreamingWriter.entry(torch.float32, (1,)),
        }
        if self.activations:
            entries[f"{prefix}input_global_scale"] = StreamingWriter.entry(torch.float32, (1,))
        return entries

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype, *,
                 weight_amax: float) -> list[torch.Tensor]:
        tensors = list(quantize_nvfp4(weight.to(scale_dtype), weight_amax))
        if self.activations:
            tensors.append(global_scale(torch.tensor([float(input_amax or 0.0)], dtype=scale_dtype)))
        return tensors

    def quantization_config(self, plan: ServingPlan) -> dict[str, Any]:
        def args(*, dynamic: bool | str, observer: str) -> dict[str, Any]:
            return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP,
                    "strategy": "tensor_group", "block_structure": None, "dynamic": dynamic, "actorder": None,
                    "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None, "observer": observer,
                    "observer_kwargs": {}}

        inputs = args(dynamic="local", observer="static_minmax") if self.activations else None
        return {
            "quant_method": "compressed-tensors",
            "format": FORMAT,
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": args(dynamic=False, observer="memoryless_minmax"),
                                          "input_activations": inputs, "output_activations": None,
                                          "format": FORMAT}},
            "ignore": ignore_list(plan),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "transform_config": {},
        }


NVFP4 = CompressedTensorsNVFP4(name="nvfp4", activations=True)
NVFP4_A16 = CompressedTensorsNVFP4(name="nvfp4-a16", activations=False)
