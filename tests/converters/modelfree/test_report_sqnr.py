"""The requantize report's per-layer weight SQNR, read from the tensors written (no second cast): the figures of the
cast before it, for each target, and finite for a weight at bf16's largest value."""

from __future__ import annotations

import math

import pytest
import torch

from converters.casts.emulation import cast_spec, db, fake_quantize
from converters.model.quantized.arithmetic import dequantize_fp8, dequantize_nvfp4
from converters.modelfree.targets import MODEL_FREE_TARGETS
from converters.serving.writer import layer_stats

TARGETS = sorted(name for name in MODEL_FREE_TARGETS if name != "bf16")
#: how far the written tensors' SQNR lies from the emulated cast's the report gave before (dB): that cast rounds as
#: TE does in fp32; compressed-tensors' FP8 divides in bf16 (a second rounding: ~0.05 dB lower), MXFP8 takes the
#: larger exponent at an amax of exactly 1.75 * 2**k, NVFP4's global scale is computed in bf16
EMULATION_GAP_DB = 0.1


def _weight(rows: int = 384, columns: int = 512) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1)
    scale = torch.exp(torch.randn(rows, 1, generator=generator))
    return (torch.randn(rows, columns, generator=generator) * 0.02 * scale).to(torch.bfloat16)


def _written(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    fmt = MODEL_FREE_TARGETS[name]
    options = {"weight_amax": float(weight.float().abs().amax())} if getattr(fmt, "needs_weight_amax", False) else {}
    tensors = fmt.quantize(weight, None, torch.bfloat16, **options)
    return dict(zip(fmt.planned_tensors("layer.weight", weight, torch.bfloat16), tensors, strict=True))


def _reference_sqnr(weight: torch.Tensor, written: dict[str, torch.Tensor]) -> float:
    """fp64 sums over the whole weight, dequantized by the checkpoint readers' arithmetic."""
    tensors = list(written.values())
    if tensors[0].dtype == torch.uint8:
        dequantized = dequantize_nvfp4(*tensors[:3], torch.float32, divide=True)
    else:
        block = (128, 128) if tensors[1].dim() == 2 and tensors[1].shape[0] != weight.shape[0] else None
        dequantized = dequantize_fp8(tensors[0], tensors[1], torch.float32, block)
    source = weight.double()
    return db(float(source.square().sum()), float((dequantized.double() - source).square().sum()))


def _emulated_sqnr(name: str, weight: torch.Tensor) -> float:
    """The figure the report gave before: the weight cast a second time by the emulation of its ``weight_cast``
    (for mxfp8-floor with floor exponents: before, the emulation's default, RCEIL, priced it a little too high)."""
    w = weight.float()
    spec = cast_spec(MODEL_FREE_TARGETS[name].weight_cast, mx_rounding="floor" if name == "mxfp8-floor" else "rceil")
    noise = (w - fake_quantize(w, spec, tensor_amax=w.abs().amax()))
    return db(float(w.square().sum()), float(noise.square().sum()))


@pytest.mark.parametrize("name", TARGETS)
def test_the_reported_sqnr_is_the_written_weights_within_rounding(name):
    weight = _weight()
    written = _written(name, weight)
    stats = layer_stats(MODEL_FREE_TARGETS[name], weight, written)
    # rounded to 0.01 dB (0.001 for fp8-block's own figures); the strips' fp32 sums are within 1e-4 dB of fp64
    assert stats["weight_sqnr_db"] == pytest.approx(_reference_sqnr(weight, written), abs=0.006)


@pytest.mark.parametrize("name", [name for name in TARGETS if not hasattr(MODEL_FREE_TARGETS[name], "layer_stats")])
def test_the_reported_sqnr_stays_near_the_emulated_cast_it_replaces(name):
    # (the formats with figures of their own, fp8-block's, measured the written tensors before: the test above)
    weight = _weight()
    stats = layer_stats(MODEL_FREE_TARGETS[name], weight, _written(name, weight))
    assert stats["weight_sqnr_db"] == pytest.approx(_emulated_sqnr(name, weight), abs=EMULATION_GAP_DB)


@pytest.mark.parametrize("name", TARGETS)
def test_a_weight_at_bf16s_largest_value_gets_finite_figures(name):
    weight = _weight()
    weight[5, 7] = torch.finfo(torch.bfloat16).max  # 448 times its power-of-two scale is past fp32's largest value
    weight[200, 3] = -torch.finfo(torch.bfloat16).max
    stats = layer_stats(MODEL_FREE_TARGETS[name], weight, _written(name, weight))
    figures = [value for value in stats.values() if isinstance(value, float)]
    assert figures and all(math.isfinite(value) for value in figures), stats
    # compressed-tensors' MXFP8 rounds that group's amax up to 2**128 (inf in bf16) and writes the group as zeros
    # (llm-compressor's bytes): about 0 dB, which the report then shows
    assert 0 <= stats["weight_sqnr_db"] < 300


def test_an_all_zero_weight_has_no_sqnr():
    weight = torch.zeros(128, 256, dtype=torch.bfloat16)
    assert layer_stats(MODEL_FREE_TARGETS["mxfp8"], weight, _written("mxfp8", weight))["weight_sqnr_db"] is None
