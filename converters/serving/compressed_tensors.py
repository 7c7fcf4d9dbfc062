"""compressed-tensors ``float-quantized`` FP8: the checkpoint format vLLM and SGLang load (and llm-compressor writes).

Two schemes, named as llm-compressor names them:

- ``FP8`` (static): per-tensor weight scale, static per-tensor ``input_scale`` from the calibrated input
  amax. Per quantized Linear: ``weight`` F8_E4M3 ``[out, in]``, ``weight_scale`` ``[1]``, ``input_scale`` ``[1]``.
- ``FP8_DYNAMIC``: per-channel weight scale ``[out, 1]``, activations scaled per token at run time (no
  calibration needed, no ``input_scale``).

Scales are ``amax / 448`` computed and stored in the model's dtype (a zero scale becomes that dtype's eps);
weights are ``clamp(w / scale, -448, 448)`` in the model's dtype, cast to ``float8_e4m3fn`` (round to nearest
even). This is compressed-tensors' own arithmetic (``calculate_qparams`` / ``quantize``, 0.19 and 0.20.1), so
the weights and scales are bit-identical to what llm-compressor 0.14 writes for the same model; the config
carries the same fields. vLLM's ``CompressedTensorsW8A8Fp8`` scheme reads it.

MoE experts: each on-disk expert matrix (``experts.<e>.w1``/``w3``/``w2``, or ``gate_proj``/``up_proj``/
``down_proj``) is quantized as a Linear weight of its own under its own name, with the same scheme: per
tensor with a static ``input_scale`` (w1 and w3 of one expert share their unit's), or per channel with
dynamic per-token activations, the two combinations vLLM's ``CompressedTensorsW8A8Fp8MoEMethod`` accepts.
transformers reports the experts' ``input_scale`` as unexpected keys and drops them (it dequantizes
experts); vLLM reads them.

FP8 KV cache (``selection.kv_cache == "fp8"``): ``kv_cache_scheme`` is static per-tensor FP8, the fields llm-compressor
writes for a ``kv_cache_scheme: {num_bits: 8, type: float, strategy: tensor, dynamic: false, symmetric: true}``
recipe (its observer ``static_minmax``), and every attention module carries ``k_scale``/``v_scale``
(:mod:`converters.serving.kv_scales`); vLLM then runs ``--kv-cache-dtype fp8`` with the calibrated scales.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from converters.calibration.scaling import E4M3_MAX as FP8_E4M3_MAX
from converters.casts.elements import divide_exactly
from converters.casts.emulation import max_abs, quotient_to_e4m3
from converters.model.safetensors_stream import SourceTensor, planned_entry
from converters.serving.kv_scales import COMPRESSED_TENSORS_KV
from converters.serving.selection import ServingSelection

__all__ = ["CompressedTensorsFP8", "STATIC", "DYNAMIC", "ignore_list"]



def _scale(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` in amax's dtype; a zero scale becomes that dtype's eps (compressed-tensors' rule)."""
    scale = divide_exactly(amax, FP8_E4M3_MAX)
    return torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)


def _quantize(weight: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """``clamp(weight / scale, -448, 448)`` as E4M3; the clamp, a pass over the quotient, only where a quotient could
    cast otherwise without it (a subnormal or eps scale: a normal one is within 2**-8 of ``amax / 448``)."""
    return quotient_to_e4m3(weight / scale, amax, scale)


class CompressedTensorsFP8:
    """One compressed-tensors FP8 scheme (see the module docstring)."""

    def __init__(self, *, name: str, static: bool) -> None:
        self.name = name
        self.static = static
        self.needs_calibration = static
        #: the emulated cast the report's weight SQNR uses (converters.serving.writer.layer_stats)
        self.weight_cast = "e4m3_tensor" if static else "e4m3_row"
        self.input_cast = "e4m3_tensor" if static else "e4m3_row"  #: static per tensor, or dynamic per token
        #: whose arithmetic the engine's dynamic input cast follows (the report's quality pass emulates it); a
        #: static input scale is read from the file
        self.input_library = None if static else "vllm"
        self.supports_kv_cache = True  #: writes ``kv_cache_scheme`` and the scales of ``selection.extra_tensors``
        self.kv_scale_convention = COMPRESSED_TENSORS_KV
        #: strips of 4x converters.rewrite.strips.STRIP_ELEMENTS: the cast's temporaries are in the model's dtype
        self.strip_factor = 4

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        return None  # the analysis' own rule (both dims multiples of 16) is the one vLLM's FP8 GEMMs need

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        prefix = weight_key.removesuffix("weight")
        out_features = weight.shape[0]
        entries = {
            weight_key: planned_entry(torch.float8_e4m3fn, weight.shape),
            f"{prefix}weight_scale": planned_entry(scale_dtype, (1,) if self.static else (out_features, 1)),
        }
        if self.static:
            entries[f"{prefix}input_scale"] = planned_entry(scale_dtype, (1,))
        return entries

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype
                 ) -> list[torch.Tensor]:
        # The math runs in the model's dtype, as compressed-tensors runs it, so the bytes match llm-compressor's.
        weight = weight.to(scale_dtype)
        amax = max_abs(weight).reshape(1) if self.static else max_abs(weight, dim=1)
        scale = _scale(amax)
        tensors = [_quantize(weight, scale, amax), scale]
        if self.static:
            tensors.append(_scale(torch.tensor([float(input_amax or 0.0)], dtype=scale_dtype)))
        return tensors

    def quantization_config(self, selection: ServingSelection) -> dict[str, Any]:
        def args(strategy: str, *, dynamic: bool, observer: str | None) -> dict[str, Any]:
            return {"num_bits": 8, "type": "float", "symmetric": True, "group_size": None, "strategy": strategy,
                    "block_structure": None, "dynamic": dynamic, "actorder": None, "scale_dtype": None,
                    "zp_dtype": None, "observer": observer, "observer_kwargs": {}}

        weights = args("tensor" if self.static else "channel", dynamic=False, observer="memoryless_minmax")
        inputs = args("tensor", dynamic=False, observer="static_minmax") if self.static \
            else args("token", dynamic=True, observer=None)
        return {
            "quant_method": "compressed-tensors",
            "format": "float-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": "float-quantized"}},
            "ignore": ignore_list(selection),
            "kv_cache_scheme": args("tensor", dynamic=False, observer="static_minmax") if selection.kv_cache else None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "transform_config": {},
        }


def ignore_list(selection: ServingSelection) -> list[str]:
    """Linears kept in high precision, MoE routers, and one ``re:`` entry per experts module kept in high precision.

    The one config group targets ``Linear``: vLLM and SGLang map that target onto their fused MoE layers
    too, and transformers' ``get_experts_scheme`` takes the first class-name group for the experts. vLLM
    asks about an experts module through names of its first expert (``<prefix>.0.gate_proj``, also for
    Mixtral's ``w1``), so a module kept in high precision is ignored by a regex on its on-disk prefix.
    """
    linears = [path for path in selection.linear_paths if path not in selection.quantized]
    experts = [f"re:{re.escape(prefix)}\\." for prefix in selection.unquantized_experts.values()]
    return linears + [gate for gate in selection.router_gates if gate not in linears] + experts


STATIC = CompressedTensorsFP8(name="compressed-tensors-fp8", static=True)
DYNAMIC = CompressedTensorsFP8(name="compressed-tensors-fp8-dynamic", static=False)
