"""The dequantization arithmetic of each stored format, one weight at a time (pure tensor functions).

Every function takes the stored tensors of one weight and returns it in ``dtype``. The order of the
operations and the dtype each runs in are the reference dequantizer's own, so the result is the same bits:

- FP8 with a scale grid (transformers ``Fp8Dequantize._dequantize_one``, DeepSeek-V3 ``weight_dequant``,
  compressed-tensors ``_dequantize`` with bf16/fp16/fp32 scales): ``fp32(code) * fp32(scale)``, the product
  rounded to fp32, then rounded to ``dtype`` (round to nearest even). An E4M3 code has 4 significant bits, so
  the fp32 product is exact for a bf16 or fp16 scale (the only rounding is the last one) and for a power-of-two
  scale; with an arbitrary fp32 scale it is rounded twice, as transformers rounds it.
- NVFP4 packed (compressed-tensors ``NVFP4PackedCompressor.decompress``): ``fp32(code) * fp32(e4m3_scale /
  global_scale)``, then ``dtype``: the division first, in fp32, as compressed-tensors divides.
- NVFP4 ModelOpt (``NVFP4QTensor.dequantize``): ``fp32(code) * fp32(e4m3_scale * weight_scale_2)``, then ``dtype``.

None of this gives back the weight the writer quantized from: quantization dropped information. Equal means
the dequantization arithmetic matches the reference library's own dequantizer bit for bit.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

__all__ = ["E2M1_CODES", "dequantize_fp8", "dequantize_nvfp4", "expand_scale", "fp8_as_float", "fp8_values",
           "lookup_fp8", "nvfp4_scale_error", "scale_shape_error", "unpack_e2m1"]

#: The value of each 4-bit E2M1 code (bit 3 the sign; code 8 is -0), as compressed-tensors and ModelOpt map them.
E2M1_CODES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_E8M0_BIAS = 127


def expand_scale(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None = None) -> torch.Tensor:
    """``scale`` broadcast to a weight of ``shape`` (``[..., rows, cols]``), as fp32.

    The scale's layout is read from its shape: one element (per tensor), ``[rows]`` or ``[rows, 1]`` (per
    channel), ``[rows, cols / g]`` (groups of ``g`` along the columns), or, with ``block``, a grid of
    ``ceil(rows / block[0]) x ceil(cols / block[1])`` blocks whose last row and column may be partial. Leading
    dims (stacked experts) must match the weight's.

    Raises:
        ValueError: the scale's shape fits none of these layouts (:func:`scale_shape_error` says which fit).
    """
    error = scale_shape_error(tuple(scale.shape), tuple(shape), block)
    if error is not None:
        raise ValueError(error)
    scale = scale.float()
    rows, cols = shape[-2], shape[-1]
    if scale.numel() == 1:
        return scale.reshape(())
    if block is not None and tuple(scale.shape[-2:]) == _grid(shape, block):
        expanded = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
        return expanded[..., :rows, :cols]
    if scale.ndim == len(shape) - 1:
        scale = scale.unsqueeze(-1)
    return scale.repeat_interleave(cols // scale.shape[-1], dim=-1)


def _grid(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1])


def scale_shape_error(scale_shape: tuple[int, ...], shape: tuple[int, ...],
                      block: tuple[int, int] | None = None) -> str | None:
    """None when a scale of ``scale_shape`` fits a weight of ``shape`` in one of :func:`expand_scale`'s layouts,
    else a sentence naming the shapes that would fit. Shapes only, so a plan can check a checkpoint's headers.

    Leading dims (stacked experts) must equal the weight's: a scale of another rank would broadcast the weight
    into a tensor of another shape, which no writer plans for.
    """
    scale_shape, shape = tuple(scale_shape), tuple(shape)
    if math.prod(scale_shape) == 1:
        return None
    if len(shape) < 2:
        return (f"a scale of shape {list(scale_shape)} does not fit a weight of shape {list(shape)}: a weight of "
                f"rank {len(shape)} takes one scale element")
    lead, (rows, cols) = shape[:-2], shape[-2:]
    if block is not None and scale_shape == (*lead, *_grid(shape, block)):
        return None
    if scale_shape in ((*lead, rows), (*lead, rows, 1)):
        return None
    if len(scale_shape) == len(shape) and scale_shape[:-1] == (*lead, rows) and scale_shape[-1] \
            and cols % scale_shape[-1] == 0:
        return None
    expected = [f"{list((*lead, *_grid(shape, block)))} (its {block[0]}x{block[1]} block grid)"] if block else []
    expected += ["one element", f"{list((*lead, rows))} or {list((*lead, rows, 1))} (per row)",
                 f"[{', '.join(str(dim) for dim in (*lead, rows))}, G] with G dividing {cols} (per group of columns)"]
    return (f"a scale of shape {list(scale_shape)} fits no layout of a weight of shape {list(shape)}; expected "
            + ", ".join(expected[:-1]) + f" or {expected[-1]}")


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.cache
def fp8_values(dtype: torch.dtype) -> torch.Tensor:
    """The fp32 value of each of the 256 bytes of an FP8 dtype."""
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()


def fp8_as_float(codes: torch.Tensor) -> torch.Tensor:
    """FP8 ``codes`` as fp32 (a fresh tensor): on a CPU each byte's value is read from the 256-entry table
    (``index_select`` with int32 indices), the same values as ``.float()``, which converts element by element there
    and is several times slower."""
    if codes.device.type != "cpu":
        return codes.float()
    return lookup_fp8(fp8_values(codes.dtype), codes)


#: codes looked up at a time (lookup_fp8): the int32 indices stay a reused 4 MiB, not 4 bytes a weight element
_LOOKUP_ELEMENTS = 1 << 20


def lookup_fp8(table: torch.Tensor, codes: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``table[byte]`` for each FP8 code of ``codes`` (a 256-entry table; its dtype is the result's), in chunks
    through one reused int32 index buffer: a weight's int32 indices at once were freshly mapped pages, whose faults
    cost more than the lookup itself. ``out``: a contiguous tensor of ``codes``' shape and the table's dtype to
    write into (returned)."""
    table = table.to(codes.device)
    out = torch.empty(codes.shape, dtype=table.dtype, device=codes.device) if out is None else out
    flat_codes, flat_out = codes.reshape(-1).view(torch.uint8), out.view(-1)
    indices = torch.empty(min(_LOOKUP_ELEMENTS, flat_codes.numel()), dtype=torch.int32, device=codes.device)
    for start in range(0, flat_codes.numel(), _LOOKUP_ELEMENTS):
        end = min(start + _LOOKUP_ELEMENTS, flat_codes.numel())
        chunk = indices[: end - start]
        _widen(flat_codes[start:end], chunk)
        torch.index_select(table, 0, chunk, out=flat_out[start:end])
    return out


def _widen(codes: torch.Tensor, into: torch.Tensor) -> None:
    """``codes`` (uint8) into ``into`` (int32, the same length). On a CPU by numpy's conversion: torch's uint8 ->
    int32 copy there costs more than the whole lookup does through numpy's
    (docs/benchmarks/calibrated-2026-12-03e.md)."""
    if codes.device.type == "cpu":  # torch's CPU tensors share their memory with numpy arrays: no copy either way
        np.copyto(into.numpy(), codes.numpy())
    else:
        into.copy_(codes)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """``dtype(fp32(weight) * fp32(scale))`` with ``scale`` broadcast by :func:`expand_scale`.

    ``scale`` may be fp32/bf16/fp16 (a multiplier), ``float8_e8m0fnu`` (a power of two) or uint8 holding a
    biased E8M0 exponent (MX formats: ``2 ** (byte - 127)``, exact in fp32 down to 2**-127, a subnormal).
    """
    # checked whole here: the row chunks below would otherwise name a chunk's shape instead of the weight's
    error = scale_shape_error(tuple(scale.shape), tuple(weight.shape), block)
    if error is not None:
        raise ValueError(error)
    if scale.dtype == torch.uint8:
        scale = torch.ldexp(torch.ones(scale.shape, dtype=torch.float32), scale.to(torch.int32) - _E8M0_BIAS)
    rows = weight.shape[-2] if weight.ndim >= 2 else 0
    if weight.dtype in _FP8_DTYPES and weight.device.type == "cpu" and scale.numel() == 1:
        # one scale: a code's value depends on the code alone, so the 256 of them are computed once (the same
        # fp32 product, then rounded to dtype) and each element reads its own (no fp32 copy of the weight)
        table = (fp8_values(weight.dtype) * expand_scale(scale, weight.shape, block)).to(dtype)
        return lookup_fp8(table, weight)
    upcast = fp8_as_float if weight.dtype in _FP8_DTYPES else torch.Tensor.float
    step = _chunk_rows(weight, block)
    if weight.ndim < 2 or scale.numel() == 1 or step >= rows:
        return (upcast(weight) * expand_scale(scale, weight.shape, block)).to(dtype)
    # Row chunks: the fp32 intermediates (the codes, the broadcast scale, the product) of a few MiB at a time
    # instead of three times the weight; each element's arithmetic is the same, so are its bits.
    out = torch.empty(weight.shape, dtype=dtype)
    for start in range(0, rows, step):
        end = min(start + step, rows)
        part = weight[..., start:end, :]
        out[..., start:end, :] = upcast(part).mul_(expand_scale(_scale_rows(scale, weight.shape, block, start, end),
                                                                part.shape, block)).to(dtype)
    return out


#: elements of one row chunk's fp32 intermediates (4 MiB each)
_CHUNK_ELEMENTS = 1 << 20


def _chunk_rows(weight: torch.Tensor, block: tuple[int, int] | None) -> int:
    """Rows per chunk: about ``_CHUNK_ELEMENTS`` elements, whole scale blocks."""
    per_row = max(1, weight.numel() // max(1, weight.shape[-2])) if weight.ndim >= 2 else 1
    unit = block[0] if block is not None else 1
    return max(unit, _CHUNK_ELEMENTS // per_row // unit * unit)


def _scale_rows(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None, start: int,
                end: int) -> torch.Tensor:
    """The part of ``scale`` that covers rows ``start:end`` of a weight of ``shape`` (``start`` a multiple of
    the block's rows); the layouts of :func:`expand_scale`."""
    rows, cols = shape[-2], shape[-1]
    if block is not None and tuple(scale.shape[-2:]) == (math.ceil(rows / block[0]), math.ceil(cols / block[1])):
        return scale[..., start // block[0]:math.ceil(end / block[0]), :]
    if scale.ndim == len(shape) - 1 and scale.shape[-1] == rows:
        return scale[..., start:end]
    return scale[..., start:end, :]


def unpack_e2m1(packed: torch.Tensor, *, negative_zero: bool = True) -> torch.Tensor:
    """Two E2M1 codes a byte (the even column in the low nibble) as fp32 values, the last dim doubled.

    ``negative_zero``: code 8 is -0.0 (compressed-tensors' ``unpack_fp4_from_uint8``, transformers); ModelOpt's
    ``NVFP4QTensor.e2m1_values`` maps it to +0.0.
    """
    codes = packed.contiguous().view(torch.uint8)
    table = torch.tensor(E2M1_CODES if negative_zero else (*E2M1_CODES[:8], 0.0, *E2M1_CODES[9:]),
                         dtype=torch.float32)
    values = torch.stack((table[(codes & 0x0F).long()], table[(codes >> 4).long()]), dim=-1)
    return values.flatten(-2)


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, tensor_scale: torch.Tensor,
                     dtype: torch.dtype, *, divide: bool) -> torch.Tensor:
    """NVFP4: E2M1 codes times their 16-element block's E4M3 scale, scaled per tensor.

    ``divide``: compressed-tensors' ``weight_global_scale`` (quantization direction: ``block / global``), code 8
    is -0.0; otherwise ModelOpt's ``weight_scale_2`` (dequantization direction: ``block * weight_scale_2``),
    code 8 is +0.0 as ModelOpt's table has it.
    """
    error = nvfp4_scale_error(tuple(packed.shape), tuple(block_scale.shape), tensor_scale.numel())
    if error is not None:
        raise ValueError(error)
    values = unpack_e2m1(packed, negative_zero=divide)
    cols, groups = values.shape[-1], block_scale.shape[-1]
    per_tensor = tensor_scale.float()
    per_tensor = per_tensor.reshape(()) if per_tensor.numel() == 1 else per_tensor.reshape(
        *block_scale.shape[:-2], 1, 1)
    per_block = block_scale.float() / per_tensor if divide else block_scale.float() * per_tensor
    blocks = values.unflatten(-1, (groups, cols // groups)) * per_block.unsqueeze(-1)
    return blocks.flatten(-2).to(dtype)


def nvfp4_scale_error(packed_shape: tuple[int, ...], block_shape: tuple[int, ...], tensor_elements: int) -> str | None:
    """None when NVFP4 block scales of ``block_shape`` and a tensor scale of ``tensor_elements`` elements fit a
    packed weight of ``packed_shape`` (``[..., rows, cols / 2]``), else a sentence naming the shapes that would."""
    packed_shape, block_shape = tuple(packed_shape), tuple(block_shape)
    if len(packed_shape) < 2:
        return f"an NVFP4 weight of shape {list(packed_shape)} is not a matrix: expected [rows, columns / 2]"
    lead, rows, cols = packed_shape[:-2], packed_shape[-2], packed_shape[-1] * 2
    groups = block_shape[-1] if block_shape else 0
    if block_shape[:-1] != (*lead, rows) or not groups or cols % groups:
        return (f"block scales of shape {list(block_shape)} do not fit an NVFP4 weight of {rows}x{cols}"
                + (f" (stacked {list(lead)})" if lead else "")
                + f"; expected {list(lead) + [rows, cols // 16]} (one per 16 columns)")
    if tensor_elements not in (1, math.prod(lead)):
        return (f"a tensor scale of {tensor_elements} elements does not fit an NVFP4 weight of shape "
                f"{list(lead) + [rows, cols]}; expected one element" + (f" or {math.prod(lead)}" if lead else ""))
    return None
