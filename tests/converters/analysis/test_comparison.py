"""What a comparison compares: the layers a recipe's shape rule excludes, and why recipes measure alike."""

from __future__ import annotations

import pytest
import torch

from converters.analysis.comparison import identical_groups, recipe_exclusions, why_identical
from converters.calibration.sensitivity import recipe_casts
from converters.casts.emulation import fake_quantize
from converters.recipes.presets import parse_compare_recipe

POW2 = ("te-mxfp8", "te-float8-block", "ao-rowwise", "ao-float8-op", "ao-mxfp8-op")


def _layer(path, in_features, out_features, cls="Linear"):
    return {"path": path, "class": cls, "in_features": in_features, "out_features": out_features}


@pytest.mark.parametrize(("name", "excluded"), [
    ("te-delayed", {}),
    ("te-mxfp8", {"down": "dim_not_divisible_by_32_for_mxfp8"}),
    ("te-float8-block", dict.fromkeys(("k", "down"), "dim_not_divisible_by_128_for_fp8_block")),
    ("te-nvfp4", dict.fromkeys(("k", "down"), "dim_not_divisible_by_128_for_nvfp4")),
])
def test_a_recipe_excludes_what_its_shape_rule_excludes_with_its_reason(name, excluded):
    layers = [_layer("q", 128, 128), _layer("k", 128, 64), _layer("down", 688, 256), _layer("c", 100, 100, "Conv1D")]
    assert recipe_exclusions(layers, parse_compare_recipe(name, "x")) == excluded


def test_power_of_two_scales_cast_alike_unless_a_value_falls_into_e4m3_subnormals():
    """Why the comparison calls the power-of-two recipes alike: scaling by 2**k only shifts E4M3's exponent."""
    casts = {name: recipe_casts(parse_compare_recipe(name, "x")).weight for name in POW2}
    generator = torch.Generator().manual_seed(0)
    narrow = torch.randn(256, 256, generator=generator).clamp(-4, 4)  # no value 2**15 below a block's amax ...
    narrow = torch.where(narrow.abs() < 1e-3, torch.full_like(narrow, 1e-3), narrow)
    outputs = [fake_quantize(narrow, spec) for spec in casts.values()]
    assert all(torch.equal(outputs[0], other) for other in outputs[1:])
    wide = narrow * torch.logspace(-7, 0, 256).unsqueeze(0)  # ... here many are: the block sizes tell apart
    outputs = [fake_quantize(wide, spec) for spec in casts.values()]
    assert not all(torch.equal(outputs[0], other) for other in outputs[1:])


def test_identical_groups_need_equal_figures_on_every_row_and_say_why():
    same = {"weight": 31.5, "input": 31.5, "output": 28.6}
    rows = [{"path": "a", "sqnr_db": {"x": same, "y": same, "z": same | {"output": 28.7}, "n": dict.fromkeys(same)}},
            {"path": "b", "sqnr_db": {"x": same, "y": same, "z": same, "n": dict.fromkeys(same)}}]
    assert identical_groups(rows, ["x", "y", "z", "n"]) == [["x", "y"]]
    recipes = [{"weight_format": "mxfp8_e4m3_block32", "input_format": "mxfp8_e4m3_block32",
                "scale_rule": {"weight": "e8m0_rceil", "input": "e8m0_rceil"}},
               {"weight_format": "e4m3_row", "input_format": "e4m3_row",
                "scale_rule": {"weight": "pow2", "input": "pow2"}}]
    assert "power of two" in why_identical(recipes)
    assert why_identical(recipes[:1] * 2).startswith("the same forward casts")
