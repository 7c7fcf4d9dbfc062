"""compressed-tensors FP8 holding torchao's ``Float8Linear`` weight casts: the serving twins of its training recipes.

(And of TE ``Float8CurrentScaling``, whose per-tensor weight cast fits the same layout: ``te_current_scaling_cast``.)

torchao 0.18 (``torchao/float8/float8_linear.py``, ``float8_scaling_utils.hp_tensor_to_float8_dynamic``,
``float8_utils.amax_to_scale`` and ``to_fp8_saturated``, ``config.Float8LinearConfig.from_recipe_name``) casts the
weight of each forward as follows, and ``Float8TrainingOpConfig`` runs the same recipe through
``matmul_with_hp_or_float8_args``:

* ``tensorwise``: one scale for the tensor, ``448 / max(amax, 1e-12)`` in float64, rounded to float32;
* ``rowwise`` and ``rowwise_with_gw_hp``: one scale per output channel (``axiswise_dim`` 0 of ``weight.t()``),
  the same quotient rounded down to a power of two (``round_scales_to_power_of_2``: ``exp2(floor(log2(s)))``);
* values: ``clamp(weight.float() * scale, -448, 448)`` cast to E4M3 (round to nearest even).

torchao's GEMM multiplies by ``scale.reciprocal()`` in float32 (``float8_ops`` ``_scaled_mm`` arguments), and that
reciprocal is what this format stores as ``weight_scale`` (float32): a serving engine computes ``weight *
weight_scale`` with exactly the training GEMM's factor. Layout: compressed-tensors ``float-quantized`` (per tensor
``[1]`` or per channel ``[out, 1]`` weight scales) with activations quantized per token at run time, the scheme
vLLM's ``CompressedTensorsW8A8Fp8`` runs (it quantizes dynamic activations per token whatever the strategy says, so
the config says ``token``). The activations are not bit-identical to training's (torchao scales them per tensor,
or per row with power-of-two scales): only the weights are the trained model's.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from converters.calibration.scaling import E4M3_MAX
from converters.model.safetensors_stream import SourceTensor, planned_entry
from converters.serving.compressed_tensors import CompressedTensorsFP8
from converters.serving.e4m3_cast import to_e4m3
from converters.serving.selection import ServingSelection

__all__ = ["AO_ROWWISE", "AO_TENSORWISE", "TE_TENSORWISE", "TorchaoFloat8", "TorchaoGranularity",
           "te_current_scaling_cast", "torchao_float8_cast"]

_EPS = 1e-12  # torchao.float8.float8_utils.EPS: the amax floor of amax_to_scale


class TorchaoGranularity(str, enum.Enum):
    """The weight scale of a training recipe: one per tensor, or one power of two per output channel.

    ``te-tensorwise`` is TE ``Float8CurrentScaling``'s weight cast (:func:`te_current_scaling_cast`), written in the
    same per-tensor layout.
    """

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"
    TE_TENSORWISE = "te-tensorwise"


def te_current_scaling_cast(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E4M3 weight, float32 scale_inv [1])``: TE ``Float8CurrentScaling``'s cast of ``weight``.

    TE's ``compute_scale_from_amax`` with the recipe's weight ``QParams`` (``power_2_scale`` off unless the training
    job set ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1``, ``amax_epsilon`` 0), as TE's reference
    ``tests/pytorch/references/ref_per_tensor_cs.py`` restates it: ``scale = fp32(448 / amax)`` (float32's largest
    value where that overflows, 1 for an all-zero weight), the weight multiplied by it, ``scale_inv = 1 / scale``.
    """
    amax = weight.abs().max().float().reshape(1)
    scale = torch.div(E4M3_MAX, amax)
    scale = torch.where(scale == torch.inf, torch.finfo(torch.float32).max, scale)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return to_e4m3(weight, scale), torch.reciprocal(scale)


def torchao_float8_cast(weight: torch.Tensor, granularity: TorchaoGranularity) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E4M3 weight [out, in], float32 weight_scale [1] or [out, 1])``: torchao's forward cast of ``weight``.

    ``weight_scale`` is the reciprocal of torchao's scale, the factor its ``_scaled_mm`` applies.
    """
    if granularity is TorchaoGranularity.TE_TENSORWISE:
        return te_current_scaling_cast(weight)
    if granularity is TorchaoGranularity.TENSORWISE:
        amax = weight.abs().max().reshape(1)
    else:
        amax = weight.abs().amax(dim=1, keepdim=True)
    scale = (E4M3_MAX / torch.clamp(amax.to(torch.float64), min=_EPS)).to(torch.float32)
    if granularity is TorchaoGranularity.ROWWISE:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    # torchao's to_fp8_saturated(tensor.to(float32) * scale)
    quantized = to_e4m3(weight, scale, power_of_two=granularity is TorchaoGranularity.ROWWISE)
    return quantized, scale.reciprocal()


class TorchaoFloat8(CompressedTensorsFP8):
    """compressed-tensors FP8 (dynamic per-token activations) holding torchao's own weight casts (module docstring)."""

    def __init__(self, *, name: str, granularity: TorchaoGranularity) -> None:
        super().__init__(name=name, static=False)
        self.granularity = TorchaoGranularity(granularity)
        self.supports_kv_cache = False  #: model-free and synced exports have no calibrated KV-cache amax
        self.weight_cast = "e4m3_row" if self.granularity is TorchaoGranularity.ROWWISE else "e4m3_tensor"

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        shape = (weight.shape[0], 1) if self.granularity is TorchaoGranularity.ROWWISE else (1,)
        return {weight_key: planned_entry(torch.float8_e4m3fn, weight.shape),
                f"{weight_key.removesuffix('weight')}weight_scale": planned_entry(torch.float32, shape)}

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype
                 ) -> list[torch.Tensor]:
        return list(torchao_float8_cast(weight, self.granularity))

    def quantization_config(self, selection: ServingSelection) -> dict[str, Any]:
        config = super().quantization_config(selection)
        weights = config["config_groups"]["group_0"]["weights"]
        weights["strategy"] = "channel" if self.granularity is TorchaoGranularity.ROWWISE else "tensor"
        weights["scale_dtype"] = "torch.float32"
        return config


AO_TENSORWISE = TorchaoFloat8(name="compressed-tensors-fp8-torchao-tensorwise",
                              granularity=TorchaoGranularity.TENSORWISE)
AO_ROWWISE = TorchaoFloat8(name="compressed-tensors-fp8-torchao-rowwise", granularity=TorchaoGranularity.ROWWISE)
TE_TENSORWISE = TorchaoFloat8(name="compressed-tensors-fp8-te-tensorwise",
                              granularity=TorchaoGranularity.TE_TENSORWISE)
