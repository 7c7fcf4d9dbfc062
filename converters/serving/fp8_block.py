"""Block-wise FP8 as transformers writes it natively: the layout of DeepSeek-V3 and Qwen3 FP8 checkpoints.

``quantization_config`` ``{"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size":
[128, 128], "modules_to_not_convert": [...]}``; per quantized Linear ``weight`` F8_E4M3 ``[out, in]`` and
``weight_scale_inv`` F32 ``[out/128, in/128]``, the dequantization multiplier of each 128x128 block
(``amax(|block|) / 448``, 1 for an all-zero block): ``w ~= weight * weight_scale_inv`` per block.
Activations are scaled per token group at run time, so no calibration is needed.

Its own eligibility rule: both dims must be multiples of 128. Partial edge blocks are legal in the format,
but transformers 5.24's CPU dequantization derives the block size from the shapes and loads wrong weights
(or fails) for them, and vLLM needs whole blocks in every fused shard but the last; such layers stay in
high precision with reason ``dim_not_divisible_by_128`` and are listed in ``modules_to_not_convert``.
Written from transformers 5.24 (``integrations/finegrained_fp8.py``) and vLLM's ``fp8`` block path.

MoE experts: each on-disk expert matrix gets its own blocks and ``weight_scale_inv`` under its own name
(``experts.<e>.w1.weight_scale_inv``), as DeepSeek-V3's and Qwen3-MoE's FP8 checkpoints store them; the
128 rule applies to each matrix (``[I, H]`` for gate and up, ``[H, I]`` for down).
"""

from __future__ import annotations

from typing import Any

import torch

from converters.analysis.reasons import Reason
from converters.calibration.scaling import E4M3_MAX as FP8_E4M3_MAX
from converters.model.safetensors_stream import SourceTensor, StreamingWriter
from converters.serving.plan import ServingPlan

__all__ = ["BLOCK", "FP8Block", "FP8_BLOCK"]

BLOCK = 128


class FP8Block:
    """transformers' fine-grained FP8: 128x128 weight blocks, dynamic activations."""

    name = "fp8-block"
    needs_calibration = False

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        """The reason a Linear of this shape stays in high precision, or None."""
        return None if in_features % BLOCK == 0 and out_features % BLOCK == 0 else Reason.SERVING_BLOCK.value

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        rows, columns = weight.shape
        return {
            weight_key: StreamingWriter.entry(torch.float8_e4m3fn, weight.shape),
            f"{weight_key}_scale_inv": StreamingWriter.entry(torch.float32, (rows // BLOCK, columns // BLOCK)),
        }

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype
                 ) -> list[torch.Tensor]:
        rows, columns = weight.shape
        blocks = weight.float().reshape(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
        scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
        quantized = (blocks / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return [quantized.reshape(rows, columns), scale.reshape(rows // BLOCK, columns // BLOCK)]

    def quantization_config(self, plan: ServingPlan) -> dict[str, Any]:
        return {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": _not_converted(plan),
        }


def _not_converted(plan: ServingPlan) -> list[str]:
    """Linears kept in high precision, MoE routers, and experts modules kept in high precision.

    An experts module is named twice when its names differ: transformers matches its own module path
    (``model.layers.1.mlp.experts``), vLLM the on-disk prefix (``model.layers.1.block_sparse_moe.experts``).
    """
    names = [path for path in plan.linear_paths if path not in plan.quantized]
    names += [gate for gate in plan.router_gates if gate not in names]
    for module, prefix in plan.unquantized_experts.items():
        names += dict.fromkeys([module, prefix])
    return names


FP8_BLOCK = FP8Block()
