"""A weight cast in strips of rows gives every format's tensors bit for bit (or is refused where it cannot)."""

from __future__ import annotations

import functools

import pytest
import torch

from converters.rewrite import cast_in_strips, strip_rows
from converters.serving import SERVING_FORMATS

ROWS, COLUMNS = 512, 256


def _weight() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    # rows of very different magnitudes, zeros and -0: the scales of each strip differ from the others'
    weight = torch.randn(ROWS, COLUMNS, generator=generator) * torch.logspace(-3, 2, ROWS).unsqueeze(1)
    weight[7] = 0.0
    weight[9, :16] = -0.0
    return weight.to(torch.bfloat16)


def _cast(fmt, weight: torch.Tensor, amax: float) -> list[torch.Tensor]:
    options = {"weight_amax": amax} if getattr(fmt, "needs_weight_amax", False) else {}
    return list(fmt.quantize(weight, 3.0, torch.bfloat16, **options))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("name", sorted(SERVING_FORMATS))
def test_a_cast_in_strips_writes_the_whole_casts_bytes(monkeypatch, name):
    monkeypatch.setattr("converters.rewrite.strips.STRIP_ELEMENTS", 1 << 12)  # 4x for formats of strip_factor 4
    fmt, weight = SERVING_FORMATS[name], _weight()
    cast = functools.partial(_cast, fmt, amax=float(weight.float().abs().amax()))
    step = strip_rows(fmt, weight)
    if fmt.weight_cast.endswith("_tensor"):
        assert step is None  # one scale from the whole tensor: never cast in strips
        return
    assert step is not None and step < ROWS
    planned = fmt.planned_tensors("layer.weight", weight, torch.bfloat16)
    strips, whole = cast_in_strips(cast, weight, step, planned), cast(weight)
    assert len(strips) == len(whole) == len(planned)
    for (output, entry), got, expected in zip(planned.items(), strips, whole, strict=True):
        assert (got.dtype, tuple(got.shape)) == (expected.dtype, tuple(expected.shape)), output
        assert tuple(got.shape) == tuple(entry.shape), output
        assert torch.equal(_bits(got), _bits(expected)), output


def test_strip_rows_keeps_whole_scale_blocks_and_leaves_small_weights_whole(monkeypatch):
    monkeypatch.setattr("converters.rewrite.strips.STRIP_ELEMENTS", 1 << 14)
    weight = _weight()
    assert strip_rows(SERVING_FORMATS["fp8-block"], weight) == 128  # 64 rows' worth, rounded up to one block
    assert strip_rows(SERVING_FORMATS["mxfp8-te"], weight) == 64
    assert strip_rows(SERVING_FORMATS["mxfp8"], weight) == 256  # its cast in bf16: strips 4x as large
    assert strip_rows(SERVING_FORMATS["compressed-tensors-fp8-dynamic"], weight) == 256
    assert strip_rows(SERVING_FORMATS["mxfp8"], weight[:256]) is None  # one strip holds it all
    assert strip_rows(SERVING_FORMATS["mxfp8"], weight.reshape(-1)) is None  # not a matrix


def test_a_per_tensor_output_that_differs_between_strips_is_refused():
    weight = _weight()
    fmt = SERVING_FORMATS["compressed-tensors-fp8"]  # a per-tensor weight scale: each strip would find its own
    planned = fmt.planned_tensors("layer.weight", weight, torch.bfloat16)
    cast = functools.partial(_cast, fmt, amax=0.0)
    with pytest.raises(ValueError, match="cannot be cast in strips"):
        cast_in_strips(cast, weight, 128, planned)
