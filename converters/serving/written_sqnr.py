"""A quantized weight's SQNR read from the tensors its writer produced: no second cast.

The report's per-layer figure is ``10 log10(sum w^2 / sum (w - dequantized)^2)``, where ``dequantized`` is what an
engine computes from the written codes and scales (``fp32(code) * fp32(scale)``, the arithmetic of
:mod:`converters.model.quantized.arithmetic`). The layout is read from the written tensors themselves:

* FP8 codes of the weight's shape, then their scale (a multiplier): one element (per tensor), ``[rows]`` or
  ``[rows, 1]`` (per row), ``[rows, G]`` (groups of columns; ``uint8``: biased E8M0 exponents, MX formats) or a
  block grid ``[rows / br, cols / bc]`` (fp8-block's 128x128);
* packed E2M1 codes ``[rows, cols / 2]`` (NVFP4), their E4M3 block scales ``[rows, cols / 16]`` and a per-tensor
  scale that divides (compressed-tensors' ``weight_global_scale``) or multiplies (ModelOpt's ``weight_scale_2``).

The weight is taken in strips of rows (whole scale blocks) whose fp32 copies stay in cache, and each strip's
squares are summed in fp32 (the sums of all strips in fp64): within about 1e-5 dB of fp64 sums over the whole
tensor. A strip whose values or squares leave fp32's range (a weight near bf16's largest value: its FP8 codes times
a power-of-two scale can exceed fp32's largest) is summed again in fp64.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import torch

from converters.casts.emulation import db
from converters.model.quantized.arithmetic import E2M1_CODES, fp8_values, lookup_fp8

__all__ = ["written_weight_sqnr"]

#: elements of one strip: its fp32 copies (the weight, the dequantized codes) stay in a core's L2 cache
_STRIP_ELEMENTS = 1 << 16
_E8M0_BIAS = 127


def written_weight_sqnr(weight: torch.Tensor, written: Mapping[str, torch.Tensor]) -> float | None:
    """The SQNR in dB (at most ``SQNR_CAP_DB``) of the weight the tensors ``written`` (name -> tensor, in the
    format's order: the codes first) hold, against ``weight`` (2-D, any float dtype); None for an all-zero weight
    or a layout this module does not read (a high-precision weight, as the bf16 target writes)."""
    if weight.dim() != 2:
        return None
    names, tensors = list(written), list(written.values())
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
    if strip is None:
        return None
    dequantize, unit = strip
    step = max(unit, _STRIP_ELEMENTS // max(1, columns) // unit * unit)
    signal = noise = 0.0
    for start in range(0, rows, step):
        end = min(start + step, rows)
        part_signal, part_noise = _sums(weight[start:end], functools.partial(dequantize, codes, start, end))
        signal, noise = signal + part_signal, noise + part_noise
    return db(signal, noise)


def _sums(weight: torch.Tensor, dequantize, dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """``(sum w^2, sum (dequantized - w)^2)`` of one strip, in ``dtype``; again in fp64 where fp32 overflows."""
    source = weight.to(dtype).reshape(-1)
    error = dequantize(dtype).reshape(-1).sub_(source)
    signal, noise = float(torch.dot(source, source)), float(torch.dot(error, error))
    if dtype == torch.float32 and not (math.isfinite(signal) and math.isfinite(noise)):
        return _sums(weight, dequantize, torch.float64)
    return signal, noise


def _fp8_strips(scale: torch.Tensor, rows: int, columns: int):
    """``(dequantize(codes, start, end, dtype), rows per unit)`` for FP8 codes with ``scale``; None for a scale
    of no layout read here."""
    if scale.dtype == torch.uint8:  # MX: biased E8M0 exponents, 2 ** (byte - 127), exact in fp32 (subnormal too)
        scale = torch.ldexp(torch.ones(scale.shape, dtype=torch.float32), scale.to(torch.int32) - _E8M0_BIAS)
    scale = scale.to(torch.float64)
    if scale.numel() == 1:
        value = scale.reshape(())
        return (lambda codes, start, end, dtype: _fp8(codes[start:end], dtype).mul_(value.to(dtype))), 1
    if tuple(scale.shape) in ((rows,), (rows, 1)):
        per_row = scale.reshape(rows, 1)
        return (lambda codes, start, end, dtype: _fp8(codes[start:end], dtype).mul_(per_row[start:end].to(dtype))), 1
    if scale.dim() != 2 or columns % scale.shape[1]:
        return None
    groups = scale.shape[1]
    if scale.shape[0] == rows:  # groups of columns
        def grouped(codes, start, end, dtype):
            values = _fp8(codes[start:end], dtype)
            values.view(end - start, groups, -1).mul_(scale[start:end].to(dtype).unsqueeze(-1))
            return values
        return grouped, 1
    if rows % scale.shape[0]:
        return None
    block_rows = rows // scale.shape[0]

    def blocks(codes, start, end, dtype):
        values = _fp8(codes[start:end], dtype)
        grid = scale[start // block_rows:end // block_rows].to(dtype)
        values.view(-1, block_rows, groups, columns // groups).mul_(grid.view(-1, 1, groups, 1))
        return values
    return blocks, block_rows


def _nvfp4_strips(block_scale: torch.Tensor, tensor_scale: torch.Tensor, *, divide: bool):
    """``(dequantize, 1)`` for packed E2M1 codes: ``code * (block_scale / tensor_scale)`` (``divide``) or
    ``code * (block_scale * tensor_scale)``, the per-block factor rounded to fp32 as the readers compute it."""
    if tensor_scale.numel() != 1:
        return None
    per_tensor = tensor_scale.float().reshape(())
    factor = block_scale.float() / per_tensor if divide else block_scale.float() * per_tensor
    groups = factor.shape[1]

    def dequantize(packed, start, end, dtype):
        pairs = torch.index_select(_e2m1_pairs(dtype), 0, packed[start:end].reshape(-1).int())
        values = pairs.view(end - start, groups, -1)
        return values.mul_(factor[start:end].to(dtype).unsqueeze(-1)).view(end - start, -1)
    return dequantize, 1


def _fp8(codes: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return lookup_fp8(fp8_values(codes.dtype).to(dtype), codes)


@functools.cache
def _e2m1_pairs(dtype: torch.dtype) -> torch.Tensor:
    """Each byte's two E2M1 values ``[256, 2]`` (the low nibble first: the even column)."""
    table = torch.tensor(E2M1_CODES, dtype=dtype)
    byte = torch.arange(256)
    return torch.stack((table[byte & 0x0F], table[byte >> 4]), dim=-1)
