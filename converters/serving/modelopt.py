"""NVIDIA ModelOpt's unified Hugging Face checkpoint: FP8 and NVFP4, as ``export_hf_checkpoint`` writes them.

Read from TensorRT-Model-Optimizer at commit 5a4242faf4147fb0688bb73e10ca30b8ad3aabb3
(``modelopt/torch/export/unified_export_hf.py`` ``_export_quantized_weight``, ``quant_utils.py``
``get_quant_config`` / ``process_layer_quant_config`` / ``to_quantized_weight``, ``convert_hf_config.py``,
``modelopt/torch/quantization/qtensor/nvfp4_tensor.py``) and vLLM's reader
(``vllm/model_executor/layers/quantization/modelopt.py`` at 00155cdecca722d98e34234c3d172725b7720b7d:
``ModelOptFp8LinearMethod``, ``ModelOptNvFp4LinearMethod``, ``is_layer_excluded``).

Files: ``hf_quant_config.json`` ``{"producer": {"name": "modelopt", "version": ...}, "quantization":
{"quant_algo": "FP8"|"NVFP4", "kv_cache_quant_algo": null|"FP8", ["group_size": 16,] "exclude_modules": [...]}}``
(the file vLLM's ``get_config_filenames`` names), and config.json's ``quantization_config`` as
``convert_hf_quant_config_format`` derives it (``quant_method: "modelopt"``, ``config_groups``, ``ignore``,
``quant_algo``, ``producer``; with an FP8 KV cache ``kv_cache_scheme: {"dynamic": false, "num_bits": 8, "type":
"float"}`` after ``quant_algo``, and no ``kv_cache_quant_algo`` key). ``exclude_modules`` lists the Linears kept
in high precision, the MoE routers and ``<prefix>*`` for each experts module kept in high precision (vLLM matches
exact names, substrings and ``fnmatch`` wildcards).

Per quantized Linear (per-tensor scales float32 of shape ``[]``, as ModelOpt writes them (``squeeze()``-d;
read back from nvidia-modelopt 0.47.0's own export of a tiny Llama: ``weight_scale`` (FP8), ``weight_scale_2``,
``input_scale``, ``k_scale``, ``v_scale`` all ``[]``); vLLM's ``PerTensorScaleParameter`` loader takes ``[]`` or
``[1]``):

- ``modelopt-fp8``: ``weight`` F8_E4M3 ``[out, in]``, ``weight_scale = amax(|w|) / 448`` (ModelOpt divides
  the Python float), ``input_scale = input_amax / 448``; the weight is ``(w / weight_scale)`` in the model's
  dtype cast to E4M3 (the same torch expression as ``to_quantized_weight``: no clamp).
- ``modelopt-nvfp4``: ``weight`` U8 ``[out, in/2]`` (the even column in the low nibble), ``weight_scale``
  F8_E4M3 ``[out, in/16]`` = ``e4m3(block_amax / (6 * weight_scale_2))`` (a zero block's scale is 1),
  ``weight_scale_2 = amax / (6 * 448)``, ``input_scale = input_amax / (6 * 448)``; codes round
  ``w / (weight_scale * weight_scale_2)`` to nearest even onto E2M1 (``NVFP4QTensor._cast_fp4``, the sign bit
  set for a negative value). Fused groups share ``weight_scale_2`` (ModelOpt unifies their weight amax before
  export; vLLM keeps one per fused layer) and ``input_scale``.

Eligibility: per-tensor FP8 takes every shape the analysis passes; NVFP4 needs ``in_features % 16 == 0``
(vLLM's ``ModelOptNvFp4LinearMethod`` refuses other shapes), reason ``in_features_not_divisible_by_16_for_nvfp4``.
A zero amax (an all-zero weight, a layer that saw no token) gives scale 1 rather than ModelOpt's assertion.

FP8 KV cache (``selection.kv_cache == "fp8"``, both algorithms): ``kv_cache_quant_algo: "FP8"`` and per attention
layer ``<attn>.k_proj.k_scale`` / ``<attn>.v_proj.v_scale`` = ``amax / 448`` in float32, shape ``[]``, unclamped
(:data:`converters.serving.kv_scales.MODELOPT_KV`, whose docstring gives the sources). ModelOpt writes the same
KV scales for NVFP4 weights (its KV bound is 448 for every KV format since PR #790).
"""

from __future__ import annotations

from typing import Any

import torch

from converters.casts.emulation import E2M1_MAX, E4M3_MAX, round_to_e2m1
from converters.model.safetensors_stream import SourceTensor, planned_entry
from converters.serving.kv_scales import MODELOPT_KV
from converters.serving.nvfp4 import GROUP, nvfp4_rule, pack_e2m1
from converters.serving.nvfp4_codes import rounding_stats, unpack_codes
from converters.serving.selection import ServingSelection

__all__ = ["MODELOPT_FP8", "MODELOPT_NVFP4", "MODELOPT_VERSION", "ModelOpt", "hf_quant_config"]

#: The ModelOpt release whose export layout this follows (and whose reader was run against it).
MODELOPT_VERSION = "0.47.0"
HF_QUANT_CONFIG = "hf_quant_config.json"
#: ``selection.kv_cache`` -> ModelOpt's ``kv_cache_quant_algo`` (``KV_CACHE_FP8`` in
#: modelopt/torch/export/model_config.py)
KV_CACHE_QUANT_ALGO = {"fp8": "FP8"}
#: convert_hf_quant_config_format's ``kv_cache_scheme`` for ``kv_cache_quant_algo: "FP8"``
FP8_KV_CACHE_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}


def _scalar(value: torch.Tensor) -> torch.Tensor:
    """A float32 per-tensor scale of shape ``[]``; a zero scale (zero amax) becomes 1."""
    value = value.to(torch.float32).reshape(())
    return torch.where(value == 0, torch.ones(()), value)


def _exclude_modules(selection: ServingSelection) -> list[str]:
    names = [path for path in selection.linear_paths if path not in selection.quantized]
    names += selection.router_gates
    names += [f"{prefix}*" for prefix in selection.unquantized_experts.values()]
    return sorted(set(names))


def hf_quant_config(quant_algo: str, selection: ServingSelection) -> dict[str, Any]:
    """The content of ``hf_quant_config.json`` (ModelOpt's ``get_quant_config`` key order)."""
    kv_cache_quant_algo = KV_CACHE_QUANT_ALGO[selection.kv_cache] if selection.kv_cache else None
    quantization: dict[str, Any] = {"quant_algo": quant_algo, "kv_cache_quant_algo": kv_cache_quant_algo}
    if quant_algo == "NVFP4":
        quantization["group_size"] = GROUP
    quantization["exclude_modules"] = _exclude_modules(selection)
    return {"producer": {"name": "modelopt", "version": MODELOPT_VERSION}, "quantization": quantization}


class ModelOpt:
    """One ModelOpt unified-checkpoint algorithm (see the module docstring)."""

    needs_calibration = True
    supports_kv_cache = True  #: writes ``kv_cache_quant_algo`` and the scales of ``selection.extra_tensors``
    kv_scale_convention = MODELOPT_KV

    def __init__(self, *, name: str, quant_algo: str) -> None:
        self.name = name
        self.quant_algo = quant_algo
        self.nvfp4 = quant_algo == "NVFP4"
        self.needs_weight_amax = self.nvfp4
        #: GPTQ rounding (converters.calibration.gptq_rounding) rounds NVFP4 weights under this layout's own steps
        self.rounding_family = "modelopt-nvfp4" if self.nvfp4 else None
        #: the emulated cast of the report's weight SQNR (ServingSelection.layer_stats): per-weight E4M3, or NVFP4
        #: blocks of 16 under the fused group's global scale
        self.weight_cast = "nvfp4_block16" if self.nvfp4 else "e4m3_tensor"
        self.input_cast = self.weight_cast  #: the emulated input cast of the calibration's SQNR under this format

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        return nvfp4_rule(in_features, out_features) if self.nvfp4 else None

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        prefix = weight_key.removesuffix("weight")
        rows, columns = weight.shape
        if not self.nvfp4:
            return {weight_key: planned_entry(torch.float8_e4m3fn, weight.shape),
                    f"{prefix}weight_scale": planned_entry(torch.float32, ()),
                    f"{prefix}input_scale": planned_entry(torch.float32, ())}
        return {weight_key: planned_entry(torch.uint8, (rows, columns // 2)),
                f"{prefix}weight_scale": planned_entry(torch.float8_e4m3fn, (rows, columns // GROUP)),
                f"{prefix}weight_scale_2": planned_entry(torch.float32, ()),
                f"{prefix}input_scale": planned_entry(torch.float32, ())}

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype,
                 weight_amax: float | None = None) -> list[torch.Tensor]:
        weight = weight.to(scale_dtype)
        input_amax_t = torch.tensor(float(input_amax or 0.0), dtype=torch.float32)
        if not self.nvfp4:
            scale = _scalar(torch.tensor(float(weight.float().abs().amax()) / E4M3_MAX))
            # a 0-dim fp32 scale, as ModelOpt divides: the quotient stays in the model's dtype before the E4M3 cast
            quantized = (weight / scale).to(torch.float8_e4m3fn)
            return [quantized, scale, _scalar(input_amax_t / E4M3_MAX)]
        if weight_amax is None:
            raise ValueError(f"{self.name} quantizes with the fused group's weight amax; none was given")
        return self.with_rounded(list(_quantize_nvfp4(weight, weight_amax)), input_amax, scale_dtype)

    def rounding_scales(self, weight: torch.Tensor, weight_amax: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """What GPTQ rounding holds fixed (NVFP4): each block's step ``weight_scale * weight_scale_2`` (fp32
        ``[out, in/16]``, what ``quantize`` divides by) and those two scale tensors."""
        _, block_scale, scale_2 = _quantize_nvfp4(weight, weight_amax)
        return block_scale.float() * scale_2, [block_scale, scale_2]

    def with_rounded(self, rounded: list[torch.Tensor], input_amax: float | None, scale_dtype: torch.dtype
                     ) -> list[torch.Tensor]:
        """The written tensors of a weight calibration already rounded: those, and the input scale."""
        input_amax_t = torch.tensor(float(input_amax or 0.0), dtype=torch.float32)
        return [*rounded, _scalar(input_amax_t / (E2M1_MAX * E4M3_MAX))]

    def rounded_stats(self, weight: torch.Tensor, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """A rounded weight's SQNR, and round to nearest's under the same scales."""
        packed, block_scale, scale_2 = tensors[:3]
        return {**rounding_stats(weight, unpack_codes(packed), block_scale.float() * scale_2), "rounding": "gptq"}

    def quantization_config(self, selection: ServingSelection) -> dict[str, Any]:
        """``convert_hf_quant_config_format`` of :meth:`side_files`' hf_quant_config.json."""
        config = hf_quant_config(self.quant_algo, selection)
        args: dict[str, Any] = {"dynamic": False, "num_bits": 4 if self.nvfp4 else 8, "type": "float"}
        if self.nvfp4:
            args["group_size"] = GROUP
        kv_cache = {"kv_cache_scheme": dict(FP8_KV_CACHE_SCHEME)} if config["quantization"]["kv_cache_quant_algo"] \
            else {}
        return {"config_groups": {"group_0": {"input_activations": dict(args), "weights": dict(args),
                                              "targets": ["Linear"]}},
                "ignore": config["quantization"]["exclude_modules"], "quant_algo": self.quant_algo, **kv_cache,
                "producer": config["producer"], "quant_method": "modelopt"}

    def side_files(self, selection: ServingSelection) -> dict[str, Any]:
        return {HF_QUANT_CONFIG: hf_quant_config(self.quant_algo, selection)}


def _quantize_nvfp4(weight: torch.Tensor, weight_amax: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ModelOpt's ``NVFP4QTensor`` arithmetic: (packed, E4M3 block scales, fp32 weight_scale_2)."""
    rows, columns = weight.shape
    scale_2 = _scalar(torch.tensor(weight_amax, dtype=torch.float32) / (E2M1_MAX * E4M3_MAX))
    blocks = weight.unflatten(-1, (columns // GROUP, GROUP))
    block_scale = blocks.abs().amax(dim=-1).float() / (E2M1_MAX * scale_2)
    block_scale = torch.where(block_scale == 0, torch.ones(()), block_scale).to(torch.float8_e4m3fn)
    scaled = (blocks / (block_scale.float() * scale_2).unsqueeze(-1)).reshape(rows, columns)
    return pack_e2m1(round_to_e2m1(scaled), scaled < 0), block_scale, scale_2


MODELOPT_FP8 = ModelOpt(name="modelopt-fp8", quant_algo="FP8")
MODELOPT_NVFP4 = ModelOpt(name="modelopt-nvfp4", quant_algo="NVFP4")
