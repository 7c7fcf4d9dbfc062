"""The requantize casts' shortcuts give the bits of the arithmetic they replace, on the values where they could differ.

Each shortcut is held against the plain formula it stands for (written out here as the formats wrote it before),
on every value next to a rounding boundary, on the edges of the number formats (zeros of both signs, subnormals,
the largest values, infinities) and on random weights of several magnitudes.
"""

from __future__ import annotations

import pytest
import torch

from converters.casts.elements import divide_exactly
from converters.casts.emulation import E2M1_MAX, E4M3_UNCLAMPED_MAX, e2m1_codes, e4m3_clamp_needed, round_to_e2m1
from converters.serving import mxfp8
from converters.serving.compressed_tensors import DYNAMIC
from converters.serving.fp8_block import FP8_BLOCK
from converters.serving.mxfp8 import MXFP8
from converters.serving.nvfp4 import pack_e2m1, pack_e2m1_codes

_GRID_DOUBLED = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0])


def _reference_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """The codes as nvfp4's export computed them: round_to_e2m1 of the clamped value, its index on the grid found
    by search, the sign bit where x < 0."""
    values = round_to_e2m1(x.clamp(-E2M1_MAX, E2M1_MAX))
    magnitude = torch.searchsorted(_GRID_DOUBLED, values.abs() * 2).to(torch.uint8)
    return magnitude | ((x < 0).to(torch.uint8) << 3)


def _neighbours(values: list[float], reach: int) -> torch.Tensor:
    """Every fp32 within ``reach`` steps of each value, both signs."""
    bits = torch.tensor(values, dtype=torch.float32).view(torch.int32).to(torch.int64)
    offsets = torch.arange(-reach, reach + 1)
    around = (bits[:, None] + offsets[None, :]).reshape(-1).clamp(0, 0x7F800000).to(torch.int32).view(torch.float32)
    return torch.cat([around, -around])


def _edges() -> torch.Tensor:
    tiny = torch.finfo(torch.float32).tiny
    values = [0.0, -0.0, 1e-45, -1e-45, tiny, -tiny, 1e-30, -1e-30, 6.0, -6.0, 6.5, 7.0, -7.0, 8.0, 1e4, 2.0 ** 22,
              2.0 ** 23, 2.0 ** 24, 2.0 ** 25, 3e38, -3e38, float("inf"), float("-inf")]
    return torch.tensor(values, dtype=torch.float32)


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("divisor", [448.0, 6.0])
def test_divide_exactly_rounds_the_quotient_once_on_every_device(device, dtype, divisor):
    # the reference: the quotient in fp64, rounded to the dtype (innocuous double rounding: 53 >= 2 * 24 + 2 bits),
    # on random bit patterns of every finite binade; a GPU's division by a Python number is off by a bit on some
    generator = torch.Generator().manual_seed(11)
    finite = torch.finfo(dtype).max
    if dtype is torch.float32:
        x = torch.randint(0, 0x7F800000, (1 << 18,), generator=generator, dtype=torch.int32).view(torch.float32)
    else:
        x = torch.randint(0, 0x7C00 if dtype is torch.float16 else 0x7F80, (1 << 16,), generator=generator,
                          dtype=torch.int32).to(torch.int16).view(dtype)
    x = torch.cat([x, -x]).clamp(-finite, finite)
    reference = (x.double() / divisor).to(dtype)
    quotient = divide_exactly(x.to(device), divisor).cpu()
    assert quotient.dtype == dtype
    assert torch.equal(quotient.view(torch.int16 if dtype.itemsize == 2 else torch.int32),
                       reference.view(torch.int16 if dtype.itemsize == 2 else torch.int32))


def test_e2m1_codes_match_the_rounding_next_to_every_boundary():
    # the ties (0.25 ... 5), the grid values, the binade edges of fp32 around them, and the saturation at 6
    boundaries = [0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 0.125, 8.0]
    x = torch.cat([_neighbours(boundaries, 4096), _edges()])
    assert torch.equal(e2m1_codes(x), _reference_e2m1_codes(x))


@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])
def test_e2m1_codes_match_the_rounding_on_random_values(spread):
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(1 << 18, generator=generator) * torch.exp(torch.randn(1 << 18, generator=generator) * spread)
    assert torch.equal(e2m1_codes(x), _reference_e2m1_codes(x))


def test_e2m1_codes_of_a_whole_binade_match_the_rounding():
    # every fp32 in [2, 4) (the 1-step range, both signs): 2**23 values each
    bits = torch.arange(0x40000000, 0x40800000, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32)
    assert torch.equal(e2m1_codes(x), _reference_e2m1_codes(x))
    assert torch.equal(e2m1_codes(-x), _reference_e2m1_codes(-x))


def test_packed_codes_put_the_even_column_in_the_low_nibble():
    codes = torch.randint(0, 16, (64, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(pack_e2m1_codes(codes), codes[:, 0::2] | (codes[:, 1::2] << 4))
    # a view that is not contiguous packs the same as its copy
    wide = torch.randint(0, 16, (64, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(pack_e2m1_codes(wide[:, :32]), pack_e2m1_codes(wide[:, :32].contiguous()))


def test_pack_e2m1_of_grid_values_keeps_its_codes():
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    values = grid[torch.randint(0, 8, (32, 64), generator=torch.Generator().manual_seed(3))]
    negative = torch.rand(32, 64, generator=torch.Generator().manual_seed(4)) < 0.5
    values = torch.where(negative, -values, values)
    magnitude = torch.searchsorted(_GRID_DOUBLED, values.abs() * 2).to(torch.uint8)
    codes = magnitude | (negative.to(torch.uint8) << 3)
    assert torch.equal(pack_e2m1(values, negative), codes[:, 0::2] | (codes[:, 1::2] << 4))


# --- the E4M3 clamp skipped where no quotient can reach it (converters.casts.emulation.e4m3_clamp_needed) ---


def test_every_value_up_to_the_unclamped_bound_casts_as_its_clamped_value():
    # every bf16 of magnitude <= 464 and every fp32 in [448, 464] (both signs): the clamp to 448 changes no byte
    bf16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    bf16 = bf16[bf16.float().abs() <= E4M3_UNCLAMPED_MAX]
    start, stop = (int(torch.tensor(v).view(torch.int32)) for v in (448.0, E4M3_UNCLAMPED_MAX))
    fp32 = torch.arange(start, stop + 1, dtype=torch.int64).to(torch.int32).view(torch.float32)
    for values in (bf16, fp32, -fp32):
        clamped = values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        assert torch.equal(values.to(torch.float8_e4m3fn).view(torch.uint8), clamped)


def _magnitudes(dtype: torch.dtype, columns: int) -> torch.Tensor:
    """Rows of random weights, each scaled to one positive finite ``dtype`` value as its amax: every bf16 or fp16
    magnitude once (subnormal ones included, where a scale rounds coarsely), and all-zero rows."""
    amax = torch.arange(1, 0x7C00 if dtype == torch.float16 else 0x7F80, dtype=torch.int32).to(torch.int16)
    amax = amax.view(dtype).float()
    generator = torch.Generator().manual_seed(11)
    rows = torch.rand(amax.numel(), columns, generator=generator) * 2 - 1
    rows[:, 0] = 1.0  # the amax itself
    weight = (rows * amax[:, None]).to(dtype)
    return torch.cat([weight, torch.zeros(2, columns, dtype=dtype), -weight[:64]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dynamic_fp8_bytes_with_the_clamp_skipped_are_the_clamped_formula(dtype):
    weight = _magnitudes(dtype, 32)
    codes, scale = DYNAMIC.quantize(weight, None, dtype)
    amax = weight.abs().amax(dim=1, keepdim=True)
    reference_scale = amax / 448
    reference_scale = torch.where(reference_scale == 0, torch.finfo(dtype).eps, reference_scale)
    reference = (weight / reference_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(scale, reference_scale)
    assert torch.equal(codes.view(torch.uint8), reference.view(torch.uint8))
    # subnormal scales exist among these rows: the clamp still runs where it is needed; normal ones never need it
    assert e4m3_clamp_needed(amax, reference_scale)
    normal = reference_scale.float() >= torch.finfo(dtype).tiny
    assert not e4m3_clamp_needed(amax[normal], reference_scale[normal])


def test_fp8_block_bytes_with_the_clamp_skipped_are_the_clamped_formula():
    # blocks of 128 rows in increasing amax: one block amax every 128 bf16 magnitudes, subnormal ones included
    magnitudes = _magnitudes(torch.bfloat16, 128)
    weight = magnitudes[: magnitudes.shape[0] // 128 * 128]
    codes, scale = FP8_BLOCK.quantize(weight, None, torch.bfloat16)
    blocks = weight.float().reshape(weight.shape[0] // 128, 128, 1, 128)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    reference_scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    reference = torch.div(blocks, reference_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(scale, reference_scale.reshape(scale.shape))
    assert torch.equal(codes.view(torch.uint8), reference.reshape(codes.shape).view(torch.uint8))
    # a bf16 block's fp32 scale is within 1% of amax / 448 even where subnormal: never a clamp
    assert not e4m3_clamp_needed(amax, reference_scale)
    # fp32 weights go down to amax 1e-45, whose scale rounds to 0 or to a few subnormal steps: the clamp runs there
    tiny = (torch.rand(256, 128, generator=torch.Generator().manual_seed(17)) * 2 - 1) * 1e-43
    codes, scale = FP8_BLOCK.quantize(tiny, None, torch.float32)
    blocks = tiny.reshape(2, 128, 1, 128)
    amax = blocks.abs().amax(dim=(1, 3), keepdim=True)
    reference_scale = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    reference = torch.div(blocks, reference_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert e4m3_clamp_needed(amax, reference_scale)
    assert torch.equal(codes.view(torch.uint8), reference.reshape(codes.shape).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp8_bytes_with_the_clamp_skipped_are_the_clamped_formula(dtype):
    weight = _magnitudes(dtype, 32)
    codes, exponent = MXFP8.quantize(weight, None, dtype)
    groups = weight.unflatten(-1, (1, 32))
    scale = mxfp8._mx_scale_reference(groups.abs().amax(dim=-1))
    reference = (groups / scale.unsqueeze(-1)).add_(0).clamp_(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(codes.view(torch.uint8), reference.flatten(-2).view(torch.uint8))
    assert torch.equal(exponent, mxfp8._e8m0_byte(scale))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mx_scales_from_the_table_are_the_formulas_on_every_16_bit_amax(dtype):
    # every bit pattern: zeros, subnormals, normals, infinities and NaNs of both signs
    amax = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(dtype)
    scale, byte = mxfp8._mx_scales(amax)
    reference = mxfp8._mx_scale_reference(amax)
    assert torch.equal(scale.view(torch.int16), reference.view(torch.int16))
    assert torch.equal(byte, mxfp8._e8m0_byte(reference))
    assert torch.equal(mxfp8.mx_scale(amax).view(torch.int16), reference.view(torch.int16))


def test_mx_scales_from_the_table_are_the_formulas_on_fp32_amax():
    generator = torch.Generator().manual_seed(13)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (1 << 20,), dtype=torch.int64, generator=generator).to(torch.int32)
    edges = torch.tensor([0.0, -0.0, 1.75, 1.7499999, 2.0, 448.0, 3.4e38, 1e-45, 1.1754942e-38, float("inf"),
                          float("-inf"), float("nan")])
    # each exponent's rounding boundaries: mantissa 0.75 - 1 ulp, 0.75, and the largest mantissa
    exponents = torch.arange(256, dtype=torch.int32) << 23
    boundaries = torch.cat([exponents + offset for offset in (0x5FFFFF, 0x600000, 0x7FFFFF)]).view(torch.float32)
    amax = torch.cat([bits.view(torch.float32), edges, boundaries])
    scale, byte = mxfp8._mx_scales(amax)
    reference = mxfp8._mx_scale_reference(amax)
    assert torch.equal(scale.view(torch.int32), reference.view(torch.int32))
    assert torch.equal(byte, mxfp8._e8m0_byte(reference))
