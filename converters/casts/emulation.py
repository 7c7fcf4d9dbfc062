"""FP8 and FP4 casts emulated on the CPU with the rounding and scale rules of the hardware recipes.

Details, and the library sources they follow: converters/calibration/README.md. The element casts beneath the scale
rules live in :mod:`converters.casts.elements` and are re-exported here, where the callers import them from.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

import torch

from converters.casts.elements import (
    E2M1_GRID,
    E2M1_MAX,
    E4M3_MAX,
    E4M3_UNCLAMPED_MAX,
    E5M2_MAX,
    cast_fp8,
    divide_exactly,
    e2m1_codes,
    e4m3_clamp_needed,
    max_abs,
    quotient_to_e4m3,
    round_to_e2m1,
)
from converters.casts.elements import FP8_ELEMENTS as _FP8
from converters.model.quantized.arithmetic import fp8_as_float as _fp8_as_float
from converters.model.quantized.arithmetic import fp8_values as _fp8_values
from converters.model.quantized.arithmetic import lookup_fp8

__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "E2M1_MAX",
    "E2M1_GRID",
    "SPEC_NAMES",
    "ScaleRule",
    "CastSpec",
    "cast_spec",
    "fake_quantize",
    "fake_quantize_per_tensor",
    "per_tensor_fp8",
    "per_tensor_scale",
    "max_abs",
    "E4M3_UNCLAMPED_MAX",
    "e4m3_clamp_needed",
    "quotient_to_e4m3",
    "cast_fp8",
    "round_to_e2m1",
    "e2m1_codes",
    "tensor_scale",
    "LIBRARIES",
    "vllm_descale",
    "e8m0_exponent",
    "nvfp4_global_scale",
    "db",
    "SQNR_CAP_DB",
]

#: The SQNR reported for an exact cast (no noise), and the most any SQNR reports.
SQNR_CAP_DB = 300.0
_FLT_MAX = float(torch.finfo(torch.float32).max)
_E4M3_EMAX = 8  # exponent of E4M3's largest power of two (256): OCP MX's emax_elem
_TORCHAO_EPS = 1e-12  # torchao.float8.float8_utils.EPS
#: the scale arithmetics a CastSpec follows (CastSpec.library)
LIBRARIES = ("te", "torchao", "vllm")


class ScaleRule(str, enum.Enum):
    """How a block's scale follows from its amax (see the module docstring)."""

    FP32 = "fp32"
    POW2 = "pow2"
    E8M0_RCEIL = "e8m0_rceil"
    E8M0_FLOOR = "e8m0_floor"
    NVFP4 = "nvfp4"


@dataclass(frozen=True, kw_only=True)
class CastSpec:
    """One cast: element format, scale block (rows x cols, None = the whole dim) and scale rule."""

    name: str
    element: str  #: e4m3, e5m2 or e2m1
    block: tuple[int | None, int | None]
    scale: ScaleRule
    #: whose fp32 arithmetic the scale follows: te, torchao, or vllm (its dynamic input cast, QuantFP8)
    library: str = "te"

    def __post_init__(self) -> None:
        if self.library not in LIBRARIES:
            raise ValueError(f"library must be one of {', '.join(LIBRARIES)}, got {self.library!r}")
        if (self.element == "e2m1") != (self.scale is ScaleRule.NVFP4):
            raise ValueError("e2m1 elements go with the nvfp4 scale rule and only with it")

    @property
    def per_tensor(self) -> bool:
        return self.block == (None, None)


# spec name -> (element, block, default scale rule); the names the recipes' cast_formats() return
_SPECS = {
    "e4m3_tensor": ("e4m3", (None, None), ScaleRule.FP32),
    "e5m2_tensor": ("e5m2", (None, None), ScaleRule.FP32),
    "e4m3_row": ("e4m3", (1, None), ScaleRule.FP32),
    "e4m3_block_1x128": ("e4m3", (1, 128), ScaleRule.POW2),
    "e4m3_block_128x128": ("e4m3", (128, 128), ScaleRule.POW2),
    "mxfp8_e4m3_block32": ("e4m3", (1, 32), ScaleRule.E8M0_RCEIL),
    "mxfp8_e4m3_block32x32": ("e4m3", (32, 32), ScaleRule.E8M0_RCEIL),  # TE MXFP8 enable_2d_quantization weights
    "nvfp4_block16": ("e2m1", (1, 16), ScaleRule.NVFP4),
    "nvfp4_block16x16": ("e2m1", (16, 16), ScaleRule.NVFP4),  # TE NVFP4 weights unless disable_2d_quantization
}
SPEC_NAMES = tuple(_SPECS)


def cast_spec(name: str, *, library: str = "te", pow2_scales: bool | None = None,
              mx_rounding: str = "rceil") -> CastSpec:
    """The :class:`CastSpec` of a spec name (``SPEC_NAMES``).

    ``pow2_scales`` overrides the default of the fp8 specs (power-of-two scales for the TE block specs, fp32
    otherwise); ``mx_rounding`` is ``rceil`` (TE, torchao training) or ``floor`` (OCP MX) for MXFP8.
    Raises ValueError for an unknown name or option.
    """
    if name not in _SPECS:
        raise ValueError(f"unknown cast spec {name!r}; known: {', '.join(SPEC_NAMES)}")
    element, block, rule = _SPECS[name]
    if rule in (ScaleRule.FP32, ScaleRule.POW2) and pow2_scales is not None:
        rule = ScaleRule.POW2 if pow2_scales else ScaleRule.FP32
    if rule is ScaleRule.E8M0_RCEIL:
        if mx_rounding not in ("rceil", "floor"):
            raise ValueError(f"mx_rounding must be rceil or floor, got {mx_rounding!r}")
        rule = ScaleRule.E8M0_RCEIL if mx_rounding == "rceil" else ScaleRule.E8M0_FLOOR
    return CastSpec(name=name, element=element, block=block, scale=rule, library=library)


def tensor_scale(amax: torch.Tensor, fp8_max: float, *, library: str = "te", pow2: bool = False) -> torch.Tensor:
    """``fp8_max / amax`` per element of ``amax`` as TE or torchao computes it (fp32; 1 where amax is 0)."""
    amax = amax.float()
    if library == "torchao":
        scale = (fp8_max / amax.double().clamp(min=_TORCHAO_EPS)).float()
        return torch.exp2(torch.floor(torch.log2(scale))) if pow2 else scale
    if library == "vllm":
        return vllm_descale(amax, fp8_max).reciprocal()
    scale = torch.tensor(fp8_max, dtype=torch.float32, device=amax.device) / amax
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, _FLT_MAX), scale)
    scale = torch.where((amax == 0) | torch.isinf(amax) | torch.isnan(scale), torch.ones_like(scale), scale)
    if pow2:  # TE clears the mantissa bits: the largest power of two <= scale
        scale = (scale.view(torch.int32) & ~0x7FFFFF).view(torch.float32)
    return scale


def e8m0_exponent(amax: torch.Tensor, *, rule: ScaleRule = ScaleRule.E8M0_RCEIL, library: str = "te"
                  ) -> torch.Tensor:
    """The biased E8M0 exponent (int32, 0..255) of an MXFP8 E4M3 block with this amax.

    ``2**(e - 127)`` is the block's dequantization scale. RCEIL: TE's ``float_to_e8m0(amax * fp32(1/448))``
    (round the exponent up unless the mantissa is 0; 0 stays 0) or torchao's ``ceil(log2(amax / 448))``;
    FLOOR: ``floor(log2(amax)) - 8`` clamped to [-127, 128], as torchao's ``to_mx``.
    """
    amax = amax.float()
    if rule is ScaleRule.E8M0_FLOOR:
        extracted = ((amax.view(torch.int32) >> 23) & 0xFF) - 127
        return (extracted - _E4M3_EMAX).clamp(-127, 128) + 127
    if library == "torchao":
        descale = divide_exactly(amax, E4M3_MAX)
        exponent = (torch.ceil(torch.log2(descale)).clamp(-127, 127) + 127).to(torch.int32)
        return torch.where(torch.isinf(descale), 254, torch.where(torch.isnan(descale), 255, exponent))
    value = amax * torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32, device=amax.device)
    bits = value.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    exponent = exponent + round_up.int()
    return torch.where(torch.isinf(value), 0xFE, torch.where(torch.isnan(value), 0xFF, exponent))


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """TE's ``compute_global_encode_scaling_factor_FP4``: ``448 * 6 / amax`` in fp32, FLT_MAX-capped, 1 for 0."""
    amax = amax.float()
    scale = torch.tensor(E4M3_MAX * E2M1_MAX, dtype=torch.float32, device=amax.device) / amax
    scale = scale.clamp(max=_FLT_MAX)
    return torch.where((amax == 0) | (scale == 0), torch.ones_like(scale), scale)


def fake_quantize(x: torch.Tensor, spec: CastSpec, *, scale: torch.Tensor | float | None = None,
                  tensor_amax: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (``[rows, K]``) cast with ``spec`` and dequantized, in fp32, same shape.

    ``scale`` replaces the computed scale of a per-tensor spec (TE delayed scaling casts with the scale its
    amax history gave, not the tensor's own). ``tensor_amax`` is the amax of the whole tensor when ``x`` is a
    slice of rows of it (whole blocks): the per-tensor scale and NVFP4's global scale come from it.
    Either may also be a ``[rows]`` vector, one value per row of ``x``: rows gathered from several tensors
    (calls of a layer), each cast as its own tensor would cast it (per-tensor specs and 1-row blocks only).
    Raises ValueError for a tensor that is not 2-D, or a ``scale`` with a spec that is not per tensor.
    """
    if x.dim() != 2:
        raise ValueError(f"fake_quantize takes [rows, K], got shape {tuple(x.shape)}")
    if scale is not None and not spec.per_tensor:
        raise ValueError(f"{spec.name} has a scale per block; only a per-tensor cast takes a given scale")
    x = x.float()
    if x.numel() == 0:
        return x.clone()
    if scale is None and tensor_amax is not None and spec.per_tensor:
        scale = per_tensor_scale(spec, tensor_amax)
    scale, tensor_amax = (_per_row(value, x.shape[0], spec) for value in (scale, tensor_amax))
    blocks, shape = _to_blocks(x, spec.block)
    if spec.scale is ScaleRule.NVFP4:
        out = _nvfp4(blocks, blocks.abs().amax() if tensor_amax is None else tensor_amax.float())
    elif spec.scale in (ScaleRule.E8M0_RCEIL, ScaleRule.E8M0_FLOOR):
        out = _mxfp8(blocks, spec)
    else:
        out = _scaled_fp8(blocks, spec, scale)
    return _from_blocks(out, shape)


def per_tensor_scale(spec: CastSpec, amax: torch.Tensor) -> torch.Tensor:
    """The scale a per-tensor FP8 ``spec`` casts a tensor of this ``amax`` with (its library's arithmetic)."""
    return tensor_scale(amax, _FP8[spec.element][1], library=spec.library, pow2=spec.scale is ScaleRule.POW2)


def per_tensor_fp8(spec: CastSpec) -> float | None:
    """The largest value of a per-tensor FP8 spec's element (its scale is ``that / amax``); None for any other
    spec (blocks, rows, MX, NVFP4)."""
    if not spec.per_tensor or spec.element not in _FP8 or spec.scale not in (ScaleRule.FP32, ScaleRule.POW2):
        return None
    return _FP8[spec.element][1]


def fake_quantize_per_tensor(x: torch.Tensor, spec: CastSpec, scale: torch.Tensor, dtype: torch.dtype,
                             *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``fake_quantize(x, spec, scale=scale).to(dtype)`` for a per-tensor FP8 spec and a one-element fp32 ``scale``,
    the same bits in fewer passes over ``x``: with one scale for the whole tensor a code's dequantized value
    depends on the code alone, so the 256 of them are computed once (each with the same fp32 arithmetic as the
    element-wise path, then rounded to ``dtype``) and every element reads its own from that table. ``x`` of any
    float dtype (upcast to fp32 inside the product, as ``x.float() * scale``); ``out``: where to write (``x``'s
    shape, ``dtype``). Raises ValueError for a spec that is not a per-tensor FP8 one."""
    if per_tensor_fp8(spec) is None:
        raise ValueError(f"{spec.name} is not a per-tensor FP8 cast")
    fp8, top = _FP8[spec.element]
    # one dimension: the product is fp32 whatever x's dtype (a 0-dim fp32 scale would keep x's)
    scale = scale.float().reshape(1).to(x.device)
    codes = torch.mul(x, scale).clamp_(-top, top).to(fp8)
    values = _fp8_values(fp8).to(x.device)
    table = (values / scale if spec.library == "torchao" else values * (1.0 / scale)).to(dtype)
    if out is not None and not out.is_contiguous():
        return out.copy_(lookup_fp8(table, codes))
    return lookup_fp8(table, codes, out)


def _per_row(value: torch.Tensor | float | None, rows: int, spec: CastSpec) -> torch.Tensor | float | None:
    """A ``[rows]`` vector of per-row scales or amaxes shaped to broadcast over ``spec``'s blocks (see
    :func:`_to_blocks`); anything else as it is."""
    if not isinstance(value, torch.Tensor) or value.dim() != 1:
        return value
    if value.numel() != rows:
        raise ValueError(f"a per-row scale or amax needs {rows} values, one per row, got {value.numel()}")
    if spec.block[0] is None:  # one block row holds every row: [1, rows, blocks, cols]
        return value.float().reshape(1, rows, 1, 1)
    if spec.block[0] == 1:  # [rows, 1, blocks, cols]
        return value.float().reshape(rows, 1, 1, 1)
    raise ValueError(f"{spec.name} has {spec.block[0]}-row blocks: rows of different tensors cannot share them")


def _to_blocks(x: torch.Tensor, block: tuple[int | None, int | None]) -> tuple[torch.Tensor, tuple[int, int]]:
    """``[R, K]`` -> ``[R/br, br, K/bc, bc]``, zero-padded to whole blocks."""
    rows, cols = x.shape
    block_rows = rows if block[0] is None else block[0]
    block_cols = cols if block[1] is None else block[1]
    pad_rows, pad_cols = -rows % block_rows, -cols % block_cols
    if pad_rows or pad_cols:
        x = torch.nn.functional.pad(x, (0, pad_cols, 0, pad_rows))
    padded_rows, padded_cols = x.shape
    return x.reshape(padded_rows // block_rows, block_rows, padded_cols // block_cols, block_cols), (rows, cols)


def _from_blocks(blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    rows = blocks.shape[0] * blocks.shape[1]
    return blocks.reshape(rows, -1)[: shape[0], : shape[1]]


def _block_amax(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.abs().amax(dim=(1, 3), keepdim=True)


def vllm_descale(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """vLLM's dynamic input scale (``QuantFP8.forward_native``, and its CUDA per-token kernel): ``amax / max``
    floored at ``1 / (max * 512)``, in fp32. The input is multiplied by its reciprocal and the codes dequantized
    by the scale itself (``torch._scaled_mm``), which differs from TE's ``max / amax`` multiplier in the last bit
    for some amax, and a bf16 input on an E4M3 rounding midpoint then gets the neighbouring code."""
    return divide_exactly(amax.float(), fp8_max).clamp_(min=1.0 / (fp8_max * 512.0))


def _scaled_fp8(blocks: torch.Tensor, spec: CastSpec, given: torch.Tensor | float | None) -> torch.Tensor:
    _, top = _FP8[spec.element]
    if given is None and spec.library == "vllm":
        descale = vllm_descale(_block_amax(blocks), top)
        q = _fp8_as_float((blocks * descale.reciprocal()).clamp_(-top, top).to(_FP8[spec.element][0]))
        return q.mul_(descale)
    if given is None:
        scale = tensor_scale(_block_amax(blocks), top, library=spec.library, pow2=spec.scale is ScaleRule.POW2)
    else:
        scale = torch.as_tensor(given, dtype=torch.float32, device=blocks.device)
    # the scaled copy and the values read back are fresh tensors: clamped and unscaled in place (each a pass over
    # the tensor without a new allocation, whose page faults cost as much as the arithmetic on a CPU)
    q = _fp8_as_float((blocks * scale).clamp_(-top, top).to(_FP8[spec.element][0]))
    if spec.library == "torchao":
        return q.div_(scale)
    return q.mul_(1.0 / scale)


def _mxfp8(blocks: torch.Tensor, spec: CastSpec) -> torch.Tensor:
    exponent = e8m0_exponent(_block_amax(blocks), rule=spec.scale, library=spec.library)
    dequant = torch.exp2(exponent.float() - 127)
    if spec.scale is ScaleRule.E8M0_FLOOR:  # torchao divides by the scale, kept at least the smallest normal
        q = cast_fp8(blocks / dequant.clamp(min=torch.finfo(torch.float32).tiny), spec.element)
    else:  # TE's exp2f_rcp: 2**(127 - e), and 1 for e == 0
        reciprocal = torch.where(exponent == 0, torch.ones_like(dequant), torch.exp2(127 - exponent.float()))
        q = cast_fp8(blocks * reciprocal, spec.element)
    return q * dequant


def _nvfp4(blocks: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    q, block_scale = _nvfp4_parts(blocks, amax)
    # TE's dequantize_fp4_kernel: q * (S_dec_b * amax * fp32(1 / (6 * 448)))
    return q * (block_scale * amax * torch.tensor(1.0 / (E2M1_MAX * E4M3_MAX), dtype=torch.float32))


def _nvfp4_parts(blocks: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NVFP4's E2M1 values and each block's E4M3 decode scale ``S_dec_b`` (TE's quantize arithmetic)."""
    encode = nvfp4_global_scale(amax)
    block_scale = cast_fp8(_block_amax(blocks) * (encode * (1.0 / E2M1_MAX)), "e4m3")  # S_dec_b, E4M3
    coefficient = (1.0 / (block_scale * (1.0 / encode))).clamp(max=_FLT_MAX)  # TE compute_scaling_coefficient
    return round_to_e2m1(blocks * coefficient), block_scale


def fake_quantize_factored(x: torch.Tensor, spec: CastSpec, *, scale: torch.Tensor | float | None = None,
                           tensor_amax: torch.Tensor | None = None, values_dtype: torch.dtype = torch.float32
                           ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """:func:`fake_quantize` split as ``(values, factor)``: ``values * factor`` is its result (to fp32 rounding), and
    ``values`` are exact in bf16 (FP8 or E2M1 codes times power-of-two or E4M3 block scales, at most 6 significant
    bits), with ``factor`` a scale per row (``[rows, 1]``), one per tensor (0-d) or None. An emulated GEMM can then
    multiply ``values`` in bf16 without rounding them and apply the factors to its fp32-accumulated output. None
    where the scales vary along a row with arbitrary fp32 values (fp32-scaled 1x128 or 128x128 blocks): no factor
    to take out. Arguments as for :func:`fake_quantize`; ``x`` of any float dtype (the FP8 scaling product is fp32
    either way); ``values_dtype``: the FP8 values' dtype (bf16 holds them exactly: no fp32 copy for a bf16 GEMM).
    """
    if spec.scale in (ScaleRule.POW2, ScaleRule.E8M0_RCEIL, ScaleRule.E8M0_FLOOR):
        return fake_quantize(x, spec, scale=scale, tensor_amax=tensor_amax), None  # codes x 2**k: exact already
    if spec.block[1] is not None and spec.scale is not ScaleRule.NVFP4:
        return None
    if x.dim() != 2:
        raise ValueError(f"fake_quantize takes [rows, K], got shape {tuple(x.shape)}")
    rows = x.shape[0]
    if spec.scale is ScaleRule.NVFP4:
        x = x.float()
        amax = x.abs().amax() if tensor_amax is None else tensor_amax.float()
        amax_blocks = _per_row(amax, rows, spec)
        blocks, shape = _to_blocks(x, spec.block)
        q, block_scale = _nvfp4_parts(blocks, amax_blocks)
        factor = amax * torch.tensor(1.0 / (E2M1_MAX * E4M3_MAX), dtype=torch.float32)
        return _from_blocks(q * block_scale, shape), (factor.reshape(rows, 1) if factor.dim() else factor)
    _, top = _FP8[spec.element]
    if scale is None:
        if spec.block[0] == 1:  # row-wise
            amax = torch.maximum(x.amax(dim=1), -x.amin(dim=1))
        else:
            amax = (torch.maximum(x.amax(), -x.amin()) if tensor_amax is None else tensor_amax).float()
        scale = tensor_scale(amax, top, library=spec.library)
    scale = torch.as_tensor(scale, dtype=torch.float32)
    per_row = scale.reshape(rows, 1) if scale.dim() else scale
    # a one-element scale as a 1-d tensor: the product is fp32 for a half x too (a 0-d one would keep x's dtype)
    codes = (x * (per_row if per_row.dim() else per_row.reshape(1))).clamp_(-top, top).to(_FP8[spec.element][0])
    if values_dtype == torch.float32:
        return _fp8_as_float(codes), 1.0 / per_row
    return lookup_fp8(_fp8_values(codes.dtype).to(values_dtype), codes), 1.0 / per_row


def db(signal: float, noise: float) -> float | None:
    """``10 log10(signal / noise)``, at most :data:`SQNR_CAP_DB` (what an exact cast, noise 0, reports).

    None without signal (an all-zero tensor, or a layer that saw no token). JSON has no infinity, and a cap
    keeps the numbers sortable; fp32 arithmetic itself leaves noise near 150 dB below the signal.
    """
    if signal <= 0:
        return None
    if noise <= 0:
        return SQNR_CAP_DB
    return min(10.0 * math.log10(signal / noise), SQNR_CAP_DB)
