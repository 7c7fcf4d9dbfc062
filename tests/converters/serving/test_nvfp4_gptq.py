"""GPTQ-rounded NVFP4 codes (converters.serving.nvfp4_gptq): lower output error than round to nearest under the
same scales, written in the writer's format, and round to nearest itself when the Hessian is the identity."""

from __future__ import annotations

import pytest
import torch

from converters.serving.nvfp4 import quantize_nvfp4
from converters.serving.nvfp4_gptq import HessianAccumulator, gptq_codes, quantize_nvfp4_gptq
from converters.serving.nvfp4_search import dequantize_nvfp4


def _correlated_inputs(rows: int, columns: int, seed: int = 0) -> torch.Tensor:
    """Inputs whose columns share a few strong directions (as a transformer's hidden states do)."""
    generator = torch.Generator().manual_seed(seed)
    basis = torch.randn(8, columns, generator=generator)
    return (torch.randn(rows, 8, generator=generator) * 3) @ basis + 0.3 * torch.randn(rows, columns,
                                                                                         generator=generator)


def _weight(rows: int, columns: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, columns, generator=generator) * 0.05).to(torch.bfloat16)


def _hessian(x: torch.Tensor) -> torch.Tensor:
    accumulator = HessianAccumulator(x.shape[1])
    for chunk in x.split(100):
        accumulator.add(chunk)
    return accumulator.matrix


@pytest.mark.parametrize("scale_search", ["rtn", "four_over_six"])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_lowers_the_output_error_on_held_out_inputs(scale_search: str, act_order: bool) -> None:
    weight = _weight(48, 128)
    amax = float(weight.float().abs().max())
    x = _correlated_inputs(1000, 128, seed=0)
    calibration, held_out = x[:600], x[600:]
    rtn = dequantize_nvfp4(*quantize_nvfp4(weight, amax, scale_search=scale_search))
    gptq = dequantize_nvfp4(*quantize_nvfp4_gptq(weight, amax, _hessian(calibration), scale_search=scale_search,
                                                 act_order=act_order))
    exact = held_out @ weight.float().T
    rtn_error = float((exact - held_out @ rtn.T).square().sum())
    gptq_error = float((exact - held_out @ gptq.T).square().sum())
    assert gptq_error < 0.8 * rtn_error
    # and the weight itself moved off round to nearest's codes (the error went somewhere)
    assert float((gptq - weight.float()).square().sum()) > float((rtn - weight.float()).square().sum())


def test_gptq_keeps_the_writers_scales_and_format() -> None:
    weight = _weight(32, 64)
    amax = float(weight.float().abs().max())
    packed, scale, scale_global = quantize_nvfp4_gptq(weight, amax, _hessian(_correlated_inputs(300, 64)))
    rtn_packed, rtn_scale, rtn_global = quantize_nvfp4(weight, amax)
    assert packed.dtype == torch.uint8 and packed.shape == rtn_packed.shape == (32, 32)
    assert scale.dtype == torch.float8_e4m3fn and torch.equal(scale.view(torch.uint8), rtn_scale.view(torch.uint8))
    assert torch.equal(scale_global, rtn_global)
    assert not torch.equal(packed, rtn_packed)
    # every code read back is on the block's grid: |w_q| <= 6 * step, and w_q / step an E2M1 value
    dequantized = dequantize_nvfp4(packed, scale, scale_global)
    step = (scale.float() / scale_global).repeat_interleave(16, dim=1)
    on_grid = (dequantized / step).abs().unsqueeze(-1) - torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])
    assert bool((on_grid.abs().amin(dim=-1) < 1e-6).all())
    # the codes of gptq_codes are the packed ones (even column in the low nibble)
    codes = gptq_codes(weight, _hessian(_correlated_inputs(300, 64)), scale, scale_global)
    assert torch.equal(codes[:, 0::2] | (codes[:, 1::2] << 4), packed)


@pytest.mark.parametrize("scale_search", ["rtn", "mse", "four_over_six"])
def test_an_identity_hessian_gives_round_to_nearest_codes(scale_search: str) -> None:
    weight = _weight(40, 96, seed=3)
    weight[0, :5] = torch.tensor([-0.0, 0.0, -1e-6, 1e-6, -0.02])  # signed zeros and values that round to zero
    amax = float(weight.float().abs().max())
    expected = quantize_nvfp4(weight, amax, scale_search=scale_search)
    for hessian in (torch.eye(96), 3.5 * torch.eye(96)):
        got = quantize_nvfp4_gptq(weight, amax, hessian, scale_search=scale_search)
        assert torch.equal(got[0], expected[0])
        assert torch.equal(got[1].view(torch.uint8), expected[1].view(torch.uint8))


def test_an_identity_hessian_gives_modelopts_round_to_nearest_bytes_under_its_steps() -> None:
    """ModelOpt's layout rounds ``w / (weight_scale * weight_scale_2)``: its format's rounding steps give GPTQ the
    same codes, so an identity Hessian writes ModelOpt's own bytes."""
    from converters.serving.modelopt import MODELOPT_NVFP4
    from converters.serving.nvfp4 import pack_e2m1_codes
    from converters.serving.nvfp4_gptq import gptq_codes_stepped

    weight = _weight(40, 96, seed=5)
    weight[0, :5] = torch.tensor([-0.0, 0.0, -1e-6, 1e-6, -0.02])
    amax = float(weight.float().abs().max())
    expected = MODELOPT_NVFP4.quantize(weight, 1.0, torch.bfloat16, weight_amax=amax)
    step, scales = MODELOPT_NVFP4.rounding_scales(weight, amax)
    assert [scale.reshape(-1).view(torch.uint8).tolist() for scale in scales] == \
        [scale.reshape(-1).view(torch.uint8).tolist() for scale in expected[1:3]]
    for act_order in (False, True):
        codes = gptq_codes_stepped(weight, torch.eye(96), step, act_order=act_order)
        assert torch.equal(pack_e2m1_codes(codes), expected[0])


def test_a_dead_input_column_and_too_few_rows_still_round() -> None:
    weight = _weight(16, 64, seed=4)
    x = _correlated_inputs(20, 64)  # fewer rows than columns: H is singular until damped
    x[:, 7] = 0
    hessian = _hessian(x)
    packed, scale, scale_global = quantize_nvfp4_gptq(weight, float(weight.float().abs().max()), hessian)
    assert torch.isfinite(dequantize_nvfp4(packed, scale, scale_global)).all()


def test_shapes_that_do_not_fit_are_refused() -> None:
    weight = _weight(16, 64)
    _, scale, scale_global = quantize_nvfp4(weight, float(weight.float().abs().max()))
    with pytest.raises(ValueError, match="do not fit"):
        gptq_codes(weight, torch.eye(32), scale, scale_global)
    with pytest.raises(ValueError, match="no inputs"):
        _ = HessianAccumulator(64).matrix
