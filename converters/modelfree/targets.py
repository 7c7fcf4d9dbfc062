"""The formats a model-free job writes: serving formats that need no calibration, and ``bf16``.

A model-free job has weights and nothing else, so a format whose checkpoint carries static input scales (a
calibrated input amax) cannot be written by it; those are refused with the command that writes them.
"""

from __future__ import annotations

from typing import Any

import torch

from converters.errors import RequestError
from converters.model.safetensors_stream import SourceTensor, planned_entry
from converters.serving import SERVING_FORMATS, ServingFormat
from converters.serving.selection import ServingSelection

__all__ = ["BF16", "BF16Target", "MODEL_FREE_TARGETS", "model_free_target", "scale_dtype_of"]


class BF16Target:
    """Every weight the source stores quantized, dequantized to bfloat16 (nothing else changes)."""

    name = "bf16"
    needs_calibration = False
    dequantize_only = True  #: quantizes nothing: what it rewrites is the source's quantized weights

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        return None

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        return {weight_key: planned_entry(torch.bfloat16, weight.shape)}

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype
                 ) -> list[torch.Tensor]:
        return [weight.to(torch.bfloat16)]

    def quantization_config(self, selection: ServingSelection) -> dict[str, Any] | None:
        return None


BF16 = BF16Target()
#: what ``fp8forge requantize --to`` accepts: every serving format without static input scales, and bf16
MODEL_FREE_TARGETS: dict[str, Any] = {name: fmt for name, fmt in SERVING_FORMATS.items()
                                      if not fmt.needs_calibration} | {BF16.name: BF16}


def model_free_target(name: str) -> ServingFormat | BF16Target:
    """The target called ``name``.

    Raises:
        RequestError (field ``to``): an unknown name, or a format that needs calibration (static input scales).
    """
    if name in MODEL_FREE_TARGETS:
        return MODEL_FREE_TARGETS[name]
    if name in SERVING_FORMATS:
        raise RequestError(f"{name} stores static input scales, which need calibration data: run a calibrated job "
                           f"(fp8forge convert MODEL --out DIR --serving {name}); a model-free conversion writes "
                           f"{', '.join(MODEL_FREE_TARGETS)}", field="to")
    raise RequestError(f"unknown target format {name!r}; model-free targets: {', '.join(MODEL_FREE_TARGETS)}",
                       field="to")


def scale_dtype_of(config: dict[str, Any]) -> str:
    """The dtype config.json declares (``dtype``, or transformers 4's ``torch_dtype``), float32 when none."""
    name = config.get("dtype") or config.get("torch_dtype")
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    return name if isinstance(dtype, torch.dtype) and dtype.is_floating_point else "float32"
