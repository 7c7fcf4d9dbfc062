"""A quantized weight's SQNR read from the tensors its writer produced: no second cast.

The report's per-layer figure is ``10 log10(sum w^2 / sum (w - dequantized)^2)``, where ``dequantized`` is what an
engine computes from the written codes and scales (``fp32(code) * fp32(scale)``, the arithmetic of
:mod:`converters.model.quantized.arithmetic`). The layout is read from the written tensors themselves:

* FP8 codes of the weight's shape, then their scale (a multiplier): one element (per tensor), ``[rows]`` or
  ``[rows, 1]`` (per row), ``[rows, G]`` (groups of columns; ``uint8``: biased E8M0 exponents, MX formats) or a
  block grid ``[rows / br, cols / bc]`` (fp8-block's 128x128);
* packed E2M1 codes ``[rows, cols / 2]`` (NVFP4), their E4M3 block scales ``[rows, cols / 16]`` and a per-tensor
  scale that divides (compressed-tensors' ``weight_global_scale``) or multiplies (ModelOpt's ``weight_scale_2``).

The weight is taken in strips of rows (whole scale blocks), each strip's squares summed in fp32 (the sums of all
strips in fp64): within about 1e-4 dB of fp64 sums over the whole tensor. A strip whose values or squares leave
fp32's range (a weight near bf16's largest value: its FP8 codes times a power-of-two scale can exceed fp32's
largest) is summed again in fp64.

The codes are decoded without a per-element table lookup, whose ``index_select`` cost more than the rest of the
sums together:

* an E4M3 byte, sign-extended to int16 and shifted left by 7 with bit 14 cleared, is the bits of an fp16 whose
  value is the code's over 256, exactly (the exponent bias is 15 against 7; subnormal codes land on fp16
  subnormals); the 256 goes into the scale, and the product ``fp16 * fp32`` is computed in fp32, the same
  rounding as ``fp32(code) * fp32(scale)``. The two NaN bytes (0x7F, 0xFF) read as +-480: no cast here writes
  them (a finite weight's quotient is clamped to 448 or bounded below it);
* NVFP4 bytes index a 256-entry table of int32s, each the two fp16 E2M1 values of a byte: one gather per two
  elements, the fp16 pairs multiplied by the block factor in fp32.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping

import torch

from converters.casts.emulation import db
from converters.model.quantized.arithmetic import E2M1_CODES

__all__ = ["written_weight_sqnr"]

#: elements of one strip: its fp32 copies (the weight, the dequantized codes) reused from strip to strip, large
#: enough that each op's fixed cost (a few microseconds) is small beside its pass over the strip
_STRIP_ELEMENTS = 1 << 18
_E8M0_BIAS = 127
#: an E4M3 code read as fp16 bits (see the module docstring) is the code's value divided by this
_FP16_CODE_UNIT = 256.0

#: ``dequantize(dtype, out)``: one strip's dequantized values written into ``out`` (``[strip rows, cols]``, dtype)
_Dequantize = Callable[[torch.dtype, torch.Tensor], torch.Tensor]


def written_weight_sqnr(weight: torch.Tensor, written: Mapping[str, torch.Tensor]) -> float | None:
    """The SQNR in dB (at most ``SQNR_CAP_DB``) of the weight the tensors ``written`` (name -> tensor, in the
    format's order: the codes first) hold, against ``weight`` (2-D, any float dtype); None for an all-zero weight
    or a layout this module does not read (a high-precision weight, as the bf16 target writes)."""
    if weight.dim() != 2:
        return None
    # read where the weight is (a GPU worker's casts leave both there; a tensor elsewhere is moved beside it)
    names, tensors = list(written), [tensor.to(weight.device) for tensor in written.values()]
    rows, columns = weight.shape
    codes = tensors[0] if tensors else None
    if codes is not None and codes.dtype == torch.float8_e4m3fn and tuple(codes.shape) == (rows, columns) \
            and len(tensors) > 1:
        strip = _fp8_strips(tensors[1], rows, columns)
    elif codes is not None and codes.dtype == torch.uint8 and tuple(codes.shape) == (rows, columns // 2) \
            and len(tensors) > 2 and tensors[1].dtype == torch.float8_e4m3fn:
        strip = _nvfp4_strips(tensors[1], tensors[2], divide=names[2].endswith("global_scale"))
    else:
        return None
    if strip is None or weight.numel() == 0:
        return None
    dequantize, unit = strip
    # a GPU takes the weight whole: each strip's sums are a sync with the host, and its memory is not the limit
    step = min(rows, max(unit, _STRIP_ELEMENTS // max(1, columns) // unit * unit))
    step = rows if weight.device.type != "cpu" else step
    # the fp32 strips, reused: a fresh tensor per strip is freshly mapped memory whose page faults cost as much as
    # the arithmetic
    source, values = (torch.empty(step * columns, device=weight.device) for _ in range(2))
    scratch: dict[str, torch.Tensor] = {}
    signal = noise = 0.0
    for start in range(0, rows, step):
        end = min(start + step, rows)
        part = functools.partial(dequantize, codes, start, end, scratch)
        part_signal, part_noise = _sums(weight[start:end], part, source, values)
        signal, noise = signal + part_signal, noise + part_noise
    return db(signal, noise)


def _sums(weight: torch.Tensor, dequantize: _Dequantize, source_buffer: torch.Tensor, values_buffer: torch.Tensor
          ) -> tuple[float, float]:
    """``(sum w^2, sum (dequantized - w)^2)`` of one strip, in fp32; again in fp64 where fp32 overflows."""
    count = weight.numel()
    source = source_buffer[:count].view(weight.shape).copy_(weight)
    error = dequantize(torch.float32, values_buffer[:count].view(weight.shape)).sub_(source)
    signal, noise = float(torch.dot(source.view(-1), source.view(-1))), float(torch.dot(error.view(-1), error.view(-1)))
    if math.isfinite(signal) and math.isfinite(noise):
        return signal, noise
    source = weight.double()
    error = dequantize(torch.float64, torch.empty(weight.shape, dtype=torch.float64, device=weight.device)).sub_(source)
    return float(torch.dot(source.view(-1), source.view(-1))), float(torch.dot(error.view(-1), error.view(-1)))


def _fp8_strips(scale: torch.Tensor, rows: int, columns: int):
    """``(dequantize(codes, start, end, scratch, dtype, out), rows per unit)`` for FP8 codes with ``scale``; None
    for a scale of no layout read here."""
    if scale.dtype == torch.uint8:  # MX: biased E8M0 exponents, 2 ** (byte - 127), exact in fp32 (subnormal too)
        scale = torch.ldexp(torch.ones(scale.shape, dtype=torch.float32, device=scale.device),
                            scale.to(torch.int32) - _E8M0_BIAS)
    # the scale times 256 (exact, in fp64): the codes are read as fp16 values 256 times smaller
    scales = _Scales(scale.to(torch.float64) * _FP16_CODE_UNIT)
    if scale.numel() == 1:
        def whole(codes, start, end, scratch, dtype, out):
            return torch.mul(_fp8_over_256(codes[start:end], scratch), scales.get(dtype).reshape(1), out=out)
        return whole, 1
    if tuple(scale.shape) in ((rows,), (rows, 1)):
        def per_row(codes, start, end, scratch, dtype, out):
            factor = scales.get(dtype).reshape(rows, 1)[start:end]
            return torch.mul(_fp8_over_256(codes[start:end], scratch), factor, out=out)
        return per_row, 1
    if scale.dim() != 2 or columns % scale.shape[1]:
        return None
    groups = scale.shape[1]
    if scale.shape[0] == rows:  # groups of columns
        def grouped(codes, start, end, scratch, dtype, out):
            halves = _fp8_over_256(codes[start:end], scratch).view(end - start, groups, -1)
            torch.mul(halves, scales.get(dtype)[start:end].unsqueeze(-1), out=out.view(end - start, groups, -1))
            return out
        return grouped, 1
    if rows % scale.shape[0]:
        return None
    block_rows = rows // scale.shape[0]

    def blocks(codes, start, end, scratch, dtype, out):
        halves = _fp8_over_256(codes[start:end], scratch).view(-1, block_rows, groups, columns // groups)
        grid = scales.get(dtype)[start // block_rows:end // block_rows].view(-1, 1, groups, 1)
        torch.mul(halves, grid, out=out.view(halves.shape))
        return out
    return blocks, block_rows


def _nvfp4_strips(block_scale: torch.Tensor, tensor_scale: torch.Tensor, *, divide: bool):
    """``(dequantize, 1)`` for packed E2M1 codes: ``code * (block_scale / tensor_scale)`` (``divide``) or
    ``code * (block_scale * tensor_scale)``, the per-block factor rounded to fp32 as the readers compute it."""
    if tensor_scale.numel() != 1:
        return None
    per_tensor = tensor_scale.float().reshape(())
    factors = _Scales(block_scale.float() / per_tensor if divide else block_scale.float() * per_tensor)
    groups = factors.get(torch.float32).shape[1]

    def dequantize(packed, start, end, scratch, dtype, out):
        part = packed[start:end].reshape(-1)
        index = _scratch(scratch, "index", part, torch.int32).copy_(part)
        pairs = torch.index_select(_e2m1_pairs(part.device), 0, index,
                                   out=_scratch(scratch, "pairs", part, torch.int32))
        halves = pairs.view(torch.float16).view(end - start, groups, -1)
        torch.mul(halves, factors.get(dtype)[start:end].unsqueeze(-1), out=out.view(halves.shape))
        return out
    return dequantize, 1


class _Scales:
    """A weight's scale factors, converted to each dtype once (not once per strip)."""

    def __init__(self, values: torch.Tensor) -> None:
        self._by_dtype = {values.dtype: values}

    def get(self, dtype: torch.dtype) -> torch.Tensor:
        if dtype not in self._by_dtype:
            self._by_dtype[dtype] = next(iter(self._by_dtype.values())).to(dtype)
        return self._by_dtype[dtype]


def _scratch(scratch: dict[str, torch.Tensor], name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A reused buffer of ``like``'s element count, on its device (the first strip's size: later strips are no
    larger)."""
    count = like.numel()
    buffer = scratch.get(name)
    if buffer is None or buffer.numel() < count:
        buffer = scratch[name] = torch.empty(count, dtype=dtype, device=like.device)
    return buffer[:count]


def _fp8_over_256(codes: torch.Tensor, scratch: dict[str, torch.Tensor]) -> torch.Tensor:
    """E4M3 ``codes`` as fp16 values each 256 times smaller than the code's, exactly (the module docstring), in a
    reused buffer of ``codes``' shape."""
    bits = _scratch(scratch, "fp8", codes, torch.int16).view(codes.shape)
    bits.copy_(codes.view(torch.int8))  # sign-extended: the sign in bits 7-15
    return bits.bitwise_left_shift_(7).bitwise_and_(~0x4000).view(torch.float16)


@functools.cache
def _e2m1_pairs(device: torch.device) -> torch.Tensor:
    """Each byte's two E2M1 values as fp16, the low nibble first (the even column), held in one int32: ``[256]``."""
    table = torch.tensor(E2M1_CODES, dtype=torch.float16)
    byte = torch.arange(256)
    pairs = torch.stack((table[byte & 0x0F], table[byte >> 4]), dim=-1).contiguous().view(torch.int32).reshape(256)
    return pairs.to(device)
