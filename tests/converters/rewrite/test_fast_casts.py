"""The requantize casts' shortcuts give the bits of the arithmetic they replace, on the values where they could differ.

Each shortcut is held against the plain formula it stands for (written out here as the formats wrote it before),
on every value next to a rounding boundary, on the edges of the number formats (zeros of both signs, subnormals,
the largest values, infinities) and on random weights of several magnitudes.
"""

from __future__ import annotations

import pytest
import torch

from converters.casts.emulation import E2M1_MAX, e2m1_codes, round_to_e2m1
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
