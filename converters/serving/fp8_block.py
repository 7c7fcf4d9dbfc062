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

UE8M0 scales (``fp8-block-ue8m0``, Blackwell): the same layout with every ``weight_scale_inv`` a power of two,
still F32, and ``"scale_fmt": "ue8m0"`` in the config, as DeepSeek-V3.1 ships it. DeepGEMM on SM100 takes only
power-of-two block scales; an engine that rounds fp32 scales at load without requantizing the weight loses
accuracy (vLLM PR #38083), so the weight is quantized with the rounded scale. The scale is rounded up to the next
power of two, so nothing clips: the rule of transformers 5.24 (``Fp8Quantize`` with ``scale_fmt="ue8m0"``:
``2**ceil(log2(amax / 448))``), of DeepSeek-V3's ``inference/kernel.py`` ``act_quant`` (``scale_fmt``) and of
TE's ``force_pow_2_scales`` (the quantization scale ``448 / amax`` rounded down). Here the exponent is exact:
the smallest ``e`` with ``448 * 2**e >= amax``, read from ``frexp(amax)`` instead of a rounded ``amax / 448``.
:meth:`FP8Block.layer_stats` gives each layer's weight SQNR with these scales and with fp32 ones.
transformers 5.24 documents ``ue8m0`` as 1-byte ``float8_e8m0fnu`` scales (DeepSeek-V4); on the CPU it
dequantizes F32 ones all the same (tested).

Training twins of TE ``Float8BlockScaling`` (128x128 weight blocks): ``fp8-block-te`` (fp32 scales) and
``fp8-block-ue8m0-te`` (power-of-two scales), the same layouts written with TE's arithmetic
(:func:`te_block_scales`: ``fp32(448 / amax)``, the weight multiplied by it, ``scale_inv`` its reciprocal), so the
FP8 weights and ``weight_scale_inv`` are the ones TE's kernel casts (:mod:`converters.sync.twins`). The
transformers arithmetic above differs from TE's in the last bit of some scales and values; ``fp8-block-ue8m0``
equals TE's power-of-two cast except for blocks whose largest value is under about 3.4e-36 (TE's scale reaches
2**-127, this one stops at 2**-126).

MoE experts: each on-disk expert matrix gets its own blocks and ``weight_scale_inv`` under its own name
(``experts.<e>.w1.weight_scale_inv``), as DeepSeek-V3's and Qwen3-MoE's FP8 checkpoints store them; the
128 rule applies to each matrix (``[I, H]`` for gate and up, ``[H, I]`` for down).
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from converters.analysis.reasons import Reason
from converters.calibration.scaling import E4M3_MAX as FP8_E4M3_MAX
from converters.casts.elements import divide_exactly
from converters.casts.emulation import max_abs, quotient_to_e4m3
from converters.model.safetensors_stream import SourceTensor, planned_entry
from converters.serving.e4m3_cast import to_e4m3
from converters.serving.selection import ServingSelection
from converters.serving.written_sqnr import written_weight_sqnr

__all__ = ["BLOCK", "FP8Block", "FP8_BLOCK", "FP8_BLOCK_TE", "FP8_BLOCK_UE8M0", "FP8_BLOCK_UE8M0_TE", "ScaleArithmetic",
           "ScaleFormat", "pow2_scale_inv", "te_block_scales"]

BLOCK = 128
_E4M3_MANTISSA_OF_MAX = 0.875  # 448 = 0.875 * 2**9, as frexp writes it
_MIN_NORMAL_EXPONENT = -126  # fp32's smallest normal power of two: a smaller scale would be subnormal


class ScaleFormat(str, enum.Enum):
    """How ``weight_scale_inv`` is stored: any fp32 value, or a power of two (transformers' ``scale_fmt``)."""

    FLOAT = "float"
    UE8M0 = "ue8m0"


def pow2_scale_inv(amax: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ``s`` with ``448 * s >= amax`` per element (fp32; 1 where amax is 0).

    ``amax = m * 2**p`` with ``m`` in [0.5, 1) and ``448 = 0.875 * 2**9``, so ``s = 2**(p - 9)`` when
    ``m <= 0.875`` and ``2**(p - 8)`` otherwise: exact, where ``ceil(log2(amax / 448))`` rounds twice.
    """
    mantissa, exponent = torch.frexp(amax.float())
    exponent = exponent - 9 + (mantissa > _E4M3_MANTISSA_OF_MAX).to(exponent.dtype)
    scale = torch.ldexp(torch.ones_like(mantissa), exponent.clamp(min=_MIN_NORMAL_EXPONENT))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


class ScaleArithmetic(str, enum.Enum):
    """Whose arithmetic turns a block's amax into its scale and its FP8 values (same layout, other last bits).

    ``transformers``: ``weight_scale_inv = amax / 448`` and ``weight / weight_scale_inv`` (transformers, DeepSeek).
    ``transformer-engine``: TE's ``Float8BlockScaling`` weight cast (:func:`te_block_scales`), the training twin.
    """

    TRANSFORMERS = "transformers"
    TRANSFORMER_ENGINE = "transformer-engine"


def te_block_scales(amax: torch.Tensor, *, pow2: bool, input_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale, scale_inv)`` of TE's block-scaled cast for fp32 ``amax``: ``weight * scale`` is cast to E4M3.

    TransformerEngine's ``compute_scale_from_amax`` (``common/recipe/recipe_common.cuh``), as its own Python
    reference restates it (``tests/pytorch/references/quantize_scale_calc.py``, held bit-exact to the CUDA kernel by
    ``tests/pytorch/test_float8_blockwise_scaling_exact.py``): ``448 / amax`` rounded once in fp32; an infinite
    quotient becomes the input dtype's largest value; ``pow2`` clears the mantissa (rounds the scale down to a
    power of two); an all-zero block gets 1; ``scale_inv = 1 / scale`` in fp32. ``amax_epsilon`` is 0, as the
    recipe records it.
    """
    amax = amax.float()
    scale = torch.div(FP8_E4M3_MAX, amax)
    scale = torch.where(scale == torch.inf, torch.finfo(input_dtype).max, scale)
    if pow2:
        _, exponent = torch.frexp(scale)
        scale = torch.ldexp(torch.ones_like(scale), exponent - 1)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    return scale, torch.reciprocal(scale)


class FP8Block:
    """transformers' fine-grained FP8: 128x128 weight blocks, dynamic activations, fp32 or power-of-two scales."""

    needs_calibration = False

    def __init__(self, *, name: str, scale_fmt: ScaleFormat = ScaleFormat.FLOAT,
                 arithmetic: ScaleArithmetic = ScaleArithmetic.TRANSFORMERS) -> None:
        self.name = name
        self.scale_fmt = ScaleFormat(scale_fmt)
        self.arithmetic = ScaleArithmetic(arithmetic)
        # the emulated casts of the calibration's SQNR under this format: 128x128 weight blocks, 1x128 input groups
        self.weight_cast, self.input_cast = "e4m3_block_128x128", "e4m3_block_1x128"
        self.pow2_scales = self.scale_fmt is ScaleFormat.UE8M0

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        """The reason a Linear of this shape stays in high precision, or None."""
        return None if in_features % BLOCK == 0 and out_features % BLOCK == 0 else Reason.SERVING_BLOCK.value

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        rows, columns = weight.shape
        return {
            weight_key: planned_entry(torch.float8_e4m3fn, weight.shape),
            f"{weight_key}_scale_inv": planned_entry(torch.float32, (rows // BLOCK, columns // BLOCK)),
        }

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype
                 ) -> list[torch.Tensor]:
        return _quantize_blocks(weight, self.scale_fmt, self.arithmetic)

    def layer_stats(self, weight: torch.Tensor, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """Weight SQNR (dB) of the written tensors, and for ue8m0 also of fp32 scales, against ``weight``.

        ``tensors`` is what :meth:`quantize` returned for ``weight``. Keys: ``weight_sqnr_db``; with ue8m0
        scales also ``weight_sqnr_db_fp32_scales`` and ``ue8m0_cost_db`` (fp32 minus ue8m0, >= 0 up to rounding).
        """
        stats = {"weight_sqnr_db": _weight_sqnr(weight, tensors)}
        if self.scale_fmt is ScaleFormat.UE8M0:
            fp32 = _weight_sqnr(weight, _quantize_blocks(weight, ScaleFormat.FLOAT, self.arithmetic))
            stats["weight_sqnr_db_fp32_scales"] = fp32
            if fp32 is not None and stats["weight_sqnr_db"] is not None:
                stats["ue8m0_cost_db"] = fp32 - stats["weight_sqnr_db"]
        return stats

    def quantization_config(self, selection: ServingSelection) -> dict[str, Any]:
        config = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": _not_converted(selection),
        }
        if self.scale_fmt is ScaleFormat.UE8M0:
            config["scale_fmt"] = self.scale_fmt.value
        return config


def _quantize_blocks(weight: torch.Tensor, scale_fmt: ScaleFormat,
                     arithmetic: ScaleArithmetic = ScaleArithmetic.TRANSFORMERS) -> list[torch.Tensor]:
    """``[weight e4m3, weight_scale_inv fp32 [rows/128, cols/128]]``; the scale is 1 for an all-zero block."""
    rows, columns = weight.shape
    if arithmetic is ScaleArithmetic.TRANSFORMER_ENGINE:
        # |w| and its max in the weight's own dtype (exact there), the product as TE's kernel computes it in fp32.
        # Multiplied by TE's scale, not divided by its inverse: the two differ in the last bit of some values.
        blocks = weight.reshape(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK)
        amax = blocks.abs().amax(dim=(1, 3), keepdim=True).float()
        pow2 = scale_fmt is ScaleFormat.UE8M0
        scale, scale_inv = te_block_scales(amax, pow2=pow2, input_dtype=weight.dtype)
        quantized = to_e4m3(blocks, scale, power_of_two=pow2)
        return [quantized.reshape(rows, columns), scale_inv.reshape(rows // BLOCK, columns // BLOCK)]
    # |w| and its block max in the weight's own dtype (exact there, half the bytes of an fp32 copy's), the
    # quotient in fp32 and clamped in place: the same bits as dividing an fp32 copy, in fewer passes over memory
    # The clamp only where a quotient could cast otherwise without it (e4m3_clamp_needed): an fp32 amax / 448 is
    # within 2**-24 of it unless subnormal, and the power of two is at least amax / 448.
    own = weight.reshape(rows // BLOCK, BLOCK, columns // BLOCK, BLOCK)
    amax = _block_amax(own)
    if scale_fmt is ScaleFormat.UE8M0:
        scale = pow2_scale_inv(amax)
    else:
        scale = torch.where(amax > 0, divide_exactly(amax, FP8_E4M3_MAX), torch.ones_like(amax))
    quantized = quotient_to_e4m3(torch.div(own, scale), amax, scale)
    return [quantized.reshape(rows, columns), scale.reshape(rows // BLOCK, columns // BLOCK)]


def _block_amax(blocks: torch.Tensor) -> torch.Tensor:
    """Each ``[.., 128, .., 128]`` block's largest ``|w|``, as fp32 ``[.., 1, .., 1]`` (exact: a max of the weight's
    own values), over the 128 columns first (contiguous: :func:`max_abs`'s vectorized int16 path for a bf16/fp16
    weight), then over the 128 rows."""
    return max_abs(max_abs(blocks, dim=3), dim=1).float()


def _weight_sqnr(weight: torch.Tensor, tensors: list[torch.Tensor]) -> float | None:
    """SQNR in dB of ``weight * weight_scale_inv`` (block-wise) against ``weight``; None for an all-zero weight.
    Read from the written tensors in cache-sized strips, in fp64 where fp32 would overflow (a weight near bf16's
    largest value with power-of-two scales: 448 times its scale exceeds fp32's range)."""
    quantized, scale = tensors
    return written_weight_sqnr(weight, {"weight": quantized, "weight_scale_inv": scale})


def _not_converted(selection: ServingSelection) -> list[str]:
    """Linears kept in high precision, MoE routers, and experts modules kept in high precision.

    An experts module is named twice when its names differ: transformers matches its own module path
    (``model.layers.1.mlp.experts``), vLLM the on-disk prefix (``model.layers.1.block_sparse_moe.experts``).
    """
    names = [path for path in selection.linear_paths if path not in selection.quantized]
    names += [gate for gate in selection.router_gates if gate not in names]
    for module, prefix in selection.unquantized_experts.items():
        names += dict.fromkeys([module, prefix])
    return names


FP8_BLOCK = FP8Block(name="fp8-block")
FP8_BLOCK_UE8M0 = FP8Block(name="fp8-block-ue8m0", scale_fmt=ScaleFormat.UE8M0)
#: the training twins of TE ``Float8BlockScaling`` (fp32 scales, and power-of-two scales): TE's own arithmetic
FP8_BLOCK_TE = FP8Block(name="fp8-block-te", arithmetic=ScaleArithmetic.TRANSFORMER_ENGINE)
FP8_BLOCK_UE8M0_TE = FP8Block(name="fp8-block-ue8m0-te", scale_fmt=ScaleFormat.UE8M0,
                              arithmetic=ScaleArithmetic.TRANSFORMER_ENGINE)
