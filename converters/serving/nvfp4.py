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
clamped to +-6 and rounded to nearest even onto E2M1 (:func:`~converters.casts.emulation.round_to_e2m1`
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

import sys
from typing import Any

import torch

from converters.analysis.reasons import Reason
from converters.casts.elements import divide_exactly
from converters.casts.emulation import E2M1_MAX, E4M3_MAX, db, e2m1_codes, max_abs, round_to_e2m1
from converters.model.quantized.arithmetic import fp8_as_float
from converters.model.safetensors_stream import SourceTensor, planned_entry
from converters.serving.compressed_tensors import ignore_list
from converters.serving.nvfp4_codes import GROUP, rounding_stats, unpack_codes
from converters.serving.selection import ServingSelection

__all__ = ["GROUP", "NVFP4", "NVFP4_A16", "SCALE_SEARCHES", "CompressedTensorsNVFP4", "block_errors", "nvfp4_rule",
           "pack_e2m1", "pack_e2m1_codes", "quantize_nvfp4", "searched_block_scales"]

FORMAT = "nvfp4-pack-quantized"
_E4M3_EPS = 0.125  # compressed-tensors' _get_dtype_eps(float8_e4m3fn)
#: how block scales are chosen: "rtn" maps each block's amax to 6 (compressed-tensors'), "mse" searches E4M3 values
#: around it, "four_over_six" maps each block's amax to 6 or to 4, whichever errs less (the recipe's
#: ``nvfp4_weight_scales``, converters.recipes.NVFP4WeightScales, names the same three)
SCALE_SEARCHES = ("rtn", "mse", "four_over_six")
_SEARCH_OFFSETS = (-4, -3, -2, -1, 1, 2, 3, 4, 5)  # E4M3 codes around RTN's: ~0.7x to ~1.6x (see searched_...)
_E4M3_MAX_CODE = 0x7E  # 448; 0x7F is NaN


def nvfp4_rule(in_features: int, out_features: int) -> str | None:
    """The reason a Linear of this shape cannot be stored in 16-element FP4 blocks, or None."""
    return None if in_features % GROUP == 0 else Reason.SERVING_NVFP4.value


def pack_e2m1(values: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """E2M1 values (``[rows, cols]``, on the grid) packed two a byte, the even column in the low nibble.

    ``negative`` says which codes carry the sign bit (engines read code 8 as -0).
    """
    return pack_e2m1_codes(e2m1_codes(values.abs()).bitwise_or_(negative.to(torch.uint8) << 3))


def pack_e2m1_codes(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes (uint8 ``[rows, cols]``, ``cols`` even) packed two a byte, the even column in the low nibble.

    Each pair of bytes read as one little-endian int16 holds the even column in its low byte: shifting it right by
    four moves the odd column's code into the high nibble of the low byte (two passes over the pairs, where
    strided even/odd halves cost three over the codes).
    """
    codes = codes.contiguous()
    if sys.byteorder != "little":
        return codes[:, 0::2] | (codes[:, 1::2] << 4)
    pairs = codes.view(torch.int16)
    return (pairs | (pairs >> 4)).to(torch.uint8)


def global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``generate_gparam``: ``448 * 6 / amax`` in amax's dtype, as fp32 ``[1]``."""
    amax = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    scale = torch.nan_to_num(E4M3_MAX * E2M1_MAX / amax, nan=1.0, posinf=1.0, neginf=1.0)
    return scale.to(torch.float32).reshape(1)


def quantize_nvfp4(weight: torch.Tensor, weight_amax: float, *, scale_search: str = "rtn"
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` (``[out, in]``, in the model's dtype) as (packed, E4M3 block scales, fp32 global scale).

    ``scale_search="rtn"`` is compressed-tensors' arithmetic, byte for byte; ``"mse"`` keeps its global scale and
    replaces each block's scale by the one of :func:`searched_block_scales` (never a larger block error).
    """
    if scale_search not in SCALE_SEARCHES:
        raise ValueError(f"scale_search must be one of {', '.join(SCALE_SEARCHES)}, got {scale_search!r}")
    rows, columns = weight.shape
    # computed on the CPU (its bits on every device), then beside the weight
    scale_global = global_scale(torch.tensor([weight_amax], dtype=weight.dtype)).to(weight.device)
    blocks = weight.unflatten(-1, (columns // GROUP, GROUP))
    scale = rtn_block_scales(blocks, scale_global)
    if scale_search != "rtn":
        scale = searched_block_scales(blocks, scale, scale_global, four_over_six_only=scale_search == "four_over_six")
    # the codes of round_to_e2m1(clamp(scaled, -6, 6)), the sign bit where scaled < 0 (e2m1_codes: no fp32 value
    # tensor, no branches)
    codes = e2m1_codes((blocks / (scale / scale_global).unsqueeze(-1)).reshape(rows, columns))
    return pack_e2m1_codes(codes), scale.to(torch.float8_e4m3fn), scale_global


def rtn_block_scales(blocks: torch.Tensor, scale_global: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' E4M3 block scales (as fp32 values) of ``blocks`` (``[out, in/16, 16]``, model dtype)."""
    block_amax = max_abs(blocks, dim=-1, keepdim=False)
    scale = scale_global * divide_exactly(block_amax, E2M1_MAX)
    # back to fp32 through the 256-entry table (fp8_as_float): the same values as .float(), which converts element
    # by element on a CPU
    scale = fp8_as_float(scale.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))
    return torch.where(scale == 0, torch.tensor(_E4M3_EPS), scale)


def block_errors(blocks: torch.Tensor, scale: torch.Tensor, scale_global: torch.Tensor) -> torch.Tensor:
    """Each block's squared reconstruction error (fp32 ``[out, in/16]``) under E4M3 block scales ``scale`` (fp32).

    The dequantization is the engines': ``e2m1_code * (scale / global)``.
    """
    step = (scale / scale_global).unsqueeze(-1)
    dequantized = round_to_e2m1((blocks / step).clamp(-E2M1_MAX, E2M1_MAX)) * step
    return (dequantized - blocks.float()).square().sum(dim=-1)


def searched_block_scales(blocks: torch.Tensor, rtn_scale: torch.Tensor, scale_global: torch.Tensor, *,
                          four_over_six_only: bool = False) -> torch.Tensor:
    """Each block's E4M3 scale of least squared reconstruction error among its candidates (fp32, E4M3 values).

    The candidates are E4M3 values themselves, so the error compared is the one the file will hold (llm-compressor's
    MSE observer compares unrounded shrunk scales, then rounds). They are the round-to-nearest scale (maps the
    block's amax to 6) and its E4M3 neighbours from four codes below (about 0.7x: clipping the block's largest
    values, as the shrink factors of llm-compressor's and ModelOpt's MSE search) to five above (about 1.6x), which
    holds the "four over six" scale (maps the amax to 4, where E2M1's 3-4 step is half its 4-6 step; Cook et al.
    2025) wherever it is exact in the format: not above E4M3's 448, so the few blocks at the top of a tensor
    whose 4-scale would overflow keep the candidates below it. Positive E4M3 values are ordered as their byte
    codes, so neighbours are codes +-1. A block keeps the round-to-nearest scale unless a candidate is strictly
    better, hence never a larger error than RTN, block by block; all-zero blocks (eps scale) are left as they are.
    ``four_over_six_only``: the 4-scale is the one candidate (fouroversix's choice between 6 and 4, per block).
    """
    best_scale, best_error = rtn_scale, block_errors(blocks, rtn_scale, scale_global)
    searchable = rtn_scale != _E4M3_EPS
    rtn_code = rtn_scale.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    four_scale = (scale_global * (blocks.abs().amax(dim=-1).float() / 4)).clamp(max=E4M3_MAX)
    four_code = four_scale.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int16)
    candidates = [four_code] if four_over_six_only else [rtn_code + offset for offset in _SEARCH_OFFSETS] + [four_code]
    for code in candidates:
        valid = searchable & (code >= 1) & (code <= _E4M3_MAX_CODE)
        scale = code.clamp(1, _E4M3_MAX_CODE).to(torch.uint8).view(torch.float8_e4m3fn).float()
        error = block_errors(blocks, scale, scale_global)
        better = valid & (error < best_error)
        best_scale = torch.where(better, scale, best_scale)
        best_error = torch.where(better, error, best_error)
    return best_scale


class CompressedTensorsNVFP4:
    """One compressed-tensors NVFP4 scheme (see the module docstring)."""

    needs_weight_amax = True
    #: GPTQ rounding (converters.calibration.gptq_rounding) rounds this family's weights once for all its formats
    rounding_family = "compressed-tensors-nvfp4"

    def __init__(self, *, name: str, activations: bool, scale_search: str = "rtn") -> None:
        if scale_search not in SCALE_SEARCHES:
            raise ValueError(f"scale_search must be one of {', '.join(SCALE_SEARCHES)}, got {scale_search!r}")
        self.name = name
        self.activations = activations
        self.scale_search = scale_search  #: how the E4M3 block scales are chosen (see quantize_nvfp4)
        self.needs_calibration = activations
        #: the emulated cast of the report's weight SQNR (ServingSelection.layer_stats)
        self.weight_cast = "nvfp4_block16"
        self.input_cast = "nvfp4_block16" if activations else None  #: and of the input (None: high precision)

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        return nvfp4_rule(in_features, out_features)

    def with_scale_search(self, scale_search: str) -> CompressedTensorsNVFP4:
        """The same scheme with block scales chosen by ``scale_search`` (one of :data:`SCALE_SEARCHES`)."""
        kind = SearchedNVFP4 if scale_search != "rtn" else CompressedTensorsNVFP4
        return kind(name=self.name, activations=self.activations, scale_search=scale_search)

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        prefix = weight_key.removesuffix("weight")
        rows, columns = weight.shape
        entries = {
            f"{prefix}weight_packed": planned_entry(torch.uint8, (rows, columns // 2)),
            f"{prefix}weight_scale": planned_entry(torch.float8_e4m3fn, (rows, columns // GROUP)),
            f"{prefix}weight_global_scale": planned_entry(torch.float32, (1,)),
        }
        if self.activations:
            entries[f"{prefix}input_global_scale"] = planned_entry(torch.float32, (1,))
        return entries

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype, *,
                 weight_amax: float) -> list[torch.Tensor]:
        rounded = list(quantize_nvfp4(weight.to(scale_dtype), weight_amax, scale_search=self.scale_search))
        return self.with_rounded(rounded, input_amax, scale_dtype)

    def with_rounded(self, rounded: list[torch.Tensor], input_amax: float | None, scale_dtype: torch.dtype
                     ) -> list[torch.Tensor]:
        """The written tensors of a weight calibration already quantized (``rounded``: packed, block scales, global
        scale, as :func:`quantize_nvfp4` returns them): those, and the input global scale where the scheme has one."""
        tensors = list(rounded)
        if self.activations:
            tensors.append(global_scale(torch.tensor([float(input_amax or 0.0)], dtype=scale_dtype)))
        return tensors

    def rounding_scales(self, weight: torch.Tensor, weight_amax: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """What GPTQ rounding holds fixed for ``weight``: each block's step (fp32 ``[out, in/16]``) and the scale
        tensors written after the codes (E4M3 block scales by ``scale_search``, the global scale)."""
        _, scale, scale_global = quantize_nvfp4(weight, weight_amax, scale_search=self.scale_search)
        return scale.float() / scale_global, [scale, scale_global]

    def rounded_stats(self, weight: torch.Tensor, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """A rounded weight's figures: the SQNR of what is written, and of round to nearest under the same scales
        (GPTQ trades weight error for output error on the calibration inputs: its weight SQNR is the lower)."""
        packed, scale, scale_global = tensors[:3]
        return {**rounding_stats(weight, unpack_codes(packed), scale.float() / scale_global), "rounding": "gptq",
                "scale_search": self.scale_search}

    def quantization_config(self, selection: ServingSelection) -> dict[str, Any]:
        def args(*, dynamic: bool | str, observer: str) -> dict[str, Any]:
            return {"num_bits": 4, "type": "float", "symmetric": True, "group_size": GROUP,
                    "strategy": "tensor_group", "block_structure": None, "dynamic": dynamic, "actorder": None,
                    "scale_dtype": "torch.float8_e4m3fn", "zp_dtype": None, "observer": observer,
                    "observer_kwargs": {}}

        inputs = args(dynamic="local", observer="static_minmax") if self.activations else None
        # informational for readers (engines ignore it): llm-compressor's name for a searched weight scale
        weight_observer = "memoryless_minmax" if self.scale_search == "rtn" else "memoryless_mse"
        return {
            "quant_method": "compressed-tensors",
            "format": FORMAT,
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"],
                                          "weights": args(dynamic=False, observer=weight_observer),
                                          "input_activations": inputs, "output_activations": None,
                                          "format": FORMAT}},
            "ignore": ignore_list(selection),
            "kv_cache_scheme": None,
            "global_compression_ratio": None,
            "sparsity_config": {},
            "transform_config": {},
        }


class SearchedNVFP4(CompressedTensorsNVFP4):
    """A scheme whose block scales were searched: the report's weight SQNR is the written tensors', beside RTN's
    (the emulated cast of ``weight_cast`` rounds to nearest, so it would show RTN's figure for a searched export)."""

    def layer_stats(self, weight: torch.Tensor, tensors: list[torch.Tensor]) -> dict[str, Any]:
        _, scale, scale_global = tensors[:3]
        blocks = weight.unflatten(-1, (weight.shape[1] // GROUP, GROUP))
        rtn_scale = rtn_block_scales(blocks, scale_global)
        signal = float(weight.float().square().sum())
        searched = float(block_errors(blocks, scale.float(), scale_global).sum())
        rounded = float(block_errors(blocks, rtn_scale, scale_global).sum())
        return {"weight_sqnr_db": db(signal, searched), "rtn_weight_sqnr_db": db(signal, rounded),
                "searched_blocks_changed": float((scale.float() != rtn_scale).float().mean()),
                "scale_search": self.scale_search}


NVFP4 = CompressedTensorsNVFP4(name="nvfp4", activations=True)
NVFP4_A16 = CompressedTensorsNVFP4(name="nvfp4-a16", activations=False)
