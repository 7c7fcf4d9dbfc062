"""compressed-tensors ``float-quantized`` FP8: the checkpoint format vLLM and SGLang load (and llm-compressor writes).

Two schemes, named as llm-compressor names them:

- ``FP8`` (static): per-tensor weight scale, static per-tensor ``input_scale`` from the calibrated input
  amax. Per quantized Linear: ``weight`` F8_E4M3 ``[out, in]``, ``weight_scale`` ``[1]``, ``input_scale`` ``[1]``.
- ``FP8_DYNAMIC``: per-channel weight scale ``[out, 1]``, activations scaled per token at run time (no
  calibration needed, no ``input_scale``).

Scales are ``amax / 448`` (an amax of 0 gives the smallest normal float32 instead, so no scale is 0), stored
in the model's dtype as llm-compressor stores them; weights are ``clamp(w / scale, -448, 448)`` cast to
``float8_e4m3fn`` (round to nearest even). Written from compressed-tensors 0.20.1 and vLLM's
``compressed_tensors_w8a8_fp8`` scheme.
"""

from __future__ import annotations

from typing import Any

import torch

from converters.formats.serving import FP8_E4M3_MAX, ServingPlan
from converters.safetensors_stream import SourceTensor, StreamingWriter

__all__ = ["CompressedTensorsFP8", "STATIC", "DYNAMIC"]

_TINY = torch.finfo(torch.float32).tiny


def _scales(amax: torch.Tensor) -> torch.Tensor:
    return torch.clamp(amax.float() / FP8_E4M3_MAX, min=_TINY)


def _quantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.clamp(weight.float() / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


class CompressedTensorsFP8:
    """One compressed-tensors FP8 scheme (see the module docstring)."""

    def __init__(self, *, name: str, static: bool) -> None:
        self.name = name
        self.static = static
        self.needs_calibration = static

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        prefix = weight_key.removesuffix("weight")
        out_features = weight.shape[0]
        entries = {
            weight_key: StreamingWriter.entry(torch.float8_e4m3fn, weight.shape),
            f"{prefix}weight_scale": StreamingWriter.entry(scale_dtype, (1,) if self.static else (out_features, 1)),
        }
        if self.static:
            entries[f"{prefix}input_scale"] = StreamingWriter.entry(scale_dtype, (1,))
        return entries

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype
                 ) -> list[torch.Tensor]:
        if self.static:
            scale = _scales(weight.abs().amax()).reshape(1)
        else:
            scale = _scales(weight.abs().amax(dim=1, keepdim=True))
        # The stored scale is what a reader multiplies by: quantize with exactly that value.
        stored = scale.to(scale_dtype)
        tensors = [_quantize(weight, stored.float()), stored]
        if self.static:
            tensors.append(_scales(torch.tensor(float(input_amax or 0.0))).reshape(1).to(scale_dtype))
        return tensors

    def quantization_config(self, plan: ServingPlan) -> dict[str, Any]:
        weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False,
                   "strategy": "tensor" if self.static else "channel", "group_size": None, "block_structure": None,
                   "actorder": None, "observer": "minmax"}
        activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": not self.static,
                       "strategy": "tensor" if self.static else "token", "group_size": None,
                       "block_structure": None, "actorder": None, "observer": "minmax" if self.static else None}
        ignored = [path for path in plan.linear_paths if path not in plan.quantized]
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": activations, "output_activations": None,
                                          "format": "float-quantized"}},
            "ignore": ignored,
            "kv_cache_scheme": None,
        }


STATIC = CompressedTensorsFP8(name="compressed-tensors-fp8", static=True)
DYNAMIC = CompressedTensorsFP8(name="compressed-tensors-fp8-dynamic", static=False)
