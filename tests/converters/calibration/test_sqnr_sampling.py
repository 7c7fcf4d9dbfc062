"""The SQNR meter's sampled figures (token rows and output channels) stay near the exact ones, outliers included."""

from __future__ import annotations

import pytest
import torch

from converters.calibration.sensitivity import recipe_casts
from converters.calibration.sqnr_meter import SqnrMeter
from converters.recipes.presets import parse_compare_recipe


def _layer(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(2048, 256, generator=generator) * 0.02
    weight[640:768] *= 8  # one block of output channels with outlier weights
    x = torch.randn(4, 512, 256, generator=generator)
    x[:, 0] *= 30  # each sequence's first token carries an outlier activation, as real models' do
    return weight.to(torch.bfloat16), x.to(torch.bfloat16)


@pytest.mark.parametrize("recipe", ["te-current", "te-delayed", "te-mxfp8", "te-nvfp4", "ao-rowwise"])
def test_sampled_sqnr_is_within_half_a_db_of_the_exact_figure(recipe):
    weight, x = _layer()
    casts = [recipe_casts(parse_compare_recipe(recipe, "test"), recipe)]
    exact, sampled = SqnrMeter(casts, max_rows=None, max_channels=None), SqnrMeter(casts)
    for step in range(4):
        output = torch.nn.functional.linear(x[step], weight)
        for meter in (exact, sampled):
            meter.observe("layer", step, x[step], weight, output=output)
    channels = sampled._channels_of("layer", weight)
    assert channels.rows is not None and channels.rows.numel() == 512  # it did sample: 4 of 16 blocks
    assert bool(torch.isin(torch.arange(640, 768), channels.rows).all())  # the outlier block is measured exactly
    got, want = sampled.result("layer", recipe), exact.result("layer", recipe)
    for what in ("weight", "input", "output"):
        assert abs(got[what] - want[what]) < 0.5, (what, got, want)


def test_small_layers_are_measured_whole():
    weight, x = _layer()
    meter = SqnrMeter([recipe_casts(parse_compare_recipe("te-current", "test"), "te-current")])
    small = weight[:512]
    meter.observe("small", 0, x[0, :16], small, output=torch.nn.functional.linear(x[0, :16], small))
    assert meter._channels_of("small", small).rows is None
    with pytest.raises(ValueError, match="max_channels"):
        SqnrMeter([], max_channels=100)
