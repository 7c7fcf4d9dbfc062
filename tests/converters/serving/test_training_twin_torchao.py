"""The torchao training twins write, bit for bit, the FP8 weights and scales torchao's own casts give the same weight.

References (torchao 0.18, installed): ``to_mx`` (``prototype/mx_formats/mx_tensor.py``, the cast
``MXFP8TrainingOpConfig``'s linear runs on the weight in its forward) with ``ScaleCalculationMode`` RCEIL and FLOOR,
and ``hp_tensor_to_float8_dynamic`` called as ``Float8Linear``'s forward calls it on ``weight.t()`` with the
settings of ``Float8LinearConfig.from_recipe_name`` (tensorwise, rowwise, rowwise_with_gw_hp).
"""

from __future__ import annotations

import pytest
import torch

from converters.serving import serving_format

pytest.importorskip("torchao")

from torchao.float8.config import Float8LinearConfig  # noqa: E402
from torchao.float8.float8_scaling_utils import get_maybe_axiswise_dim, hp_tensor_to_float8_dynamic  # noqa: E402
from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig  # noqa: E402
from torchao.prototype.mx_formats.config import ScaleCalculationMode  # noqa: E402
from torchao.prototype.mx_formats.mx_tensor import to_mx  # noqa: E402


def weight_with_edges(rows: int, columns: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Rows spread over twelve decades, plus the values where rounding a scale could go either way.

    Row 0 zero (and -0), row 1 holds 1.75 * 2**k (``amax / 448`` exactly a power of two), row 2 exact powers of two,
    row 3 the largest bf16 values, row 4 tiny normal values, row 5 one outlier per 32-group.
    """
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator, dtype=torch.float64)
    weight *= torch.pow(10.0, torch.empty(rows, 1, dtype=torch.float64).uniform_(-9, 3, generator=generator))
    weight[0] = 0.0
    weight[0, ::2] = -0.0
    exponents = torch.arange(columns, dtype=torch.float64) % 40 - 20
    weight[1] = 1.75 * torch.pow(2.0, exponents) * torch.where(exponents % 2 == 0, 1.0, -1.0)
    weight[2] = torch.pow(2.0, exponents)
    weight[3] = torch.finfo(torch.bfloat16).max * torch.linspace(-1, 1, columns, dtype=torch.float64)
    weight[4] = torch.finfo(torch.float32).tiny * torch.linspace(1, 64, columns, dtype=torch.float64)
    weight[5, ::32] *= 1e4
    return weight.to(dtype)


DTYPES = [torch.bfloat16, torch.float32]


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "mode"), [("mxfp8-rceil", ScaleCalculationMode.RCEIL),
                                            ("mxfp8-floor", ScaleCalculationMode.FLOOR)])
def test_mxfp8_twins_are_torchaos_to_mx(name, mode, dtype):
    weight = weight_with_edges(64, 512, dtype)
    quantized, exponent = serving_format(name).quantize(weight, None, dtype)
    scale_ref, data_ref = to_mx(weight, torch.float8_e4m3fn, 32, mode)
    assert exponent.dtype == torch.uint8 and exponent.shape == (64, 16)
    assert torch.equal(exponent, scale_ref.view(torch.uint8))
    assert torch.equal(_bytes(quantized), _bytes(data_ref))


def test_the_compressed_tensors_mxfp8_is_not_torchaos_rceil():
    """Why the twins exist: llm-compressor's rounding picks another exponent than RCEIL for some groups."""
    weight = weight_with_edges(64, 512, torch.bfloat16)
    _, exponent = serving_format("mxfp8").quantize(weight, None, torch.bfloat16)
    scale_ref, _ = to_mx(weight, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    assert not torch.equal(exponent, scale_ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_te_mxfp8_agrees_with_torchao_rceil_on_half_precision_weights(dtype):
    """TE rounds ``amax * fp32(1/448)`` up with the E8M0 cast; torchao takes ``ceil(log2(amax / 448))``: for a
    16-bit amax they choose the same exponent (the product and the quotient cannot straddle a power of two).
    Blocks under 448 * 2**-127 are left out: there TE multiplies by 2**127 and torchao by 1."""
    weight = weight_with_edges(64, 512, dtype)
    weight[3] = torch.finfo(dtype).max * torch.linspace(-1, 1, 512)
    weight[4] = 1.0
    reference = weight.float() if dtype is torch.float16 else weight  # to_mx takes bf16 or fp32
    quantized, exponent = serving_format("mxfp8-te").quantize(weight, None, dtype)
    scale_ref, data_ref = to_mx(reference, torch.float8_e4m3fn, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(exponent, scale_ref.view(torch.uint8))
    assert torch.equal(_bytes(quantized), _bytes(data_ref))


def _torchao_weight_cast(weight: torch.Tensor, recipe: str):
    """What ``Float8Linear.forward`` casts the weight to under ``recipe`` (its call, with its config's settings)."""
    config = Float8LinearConfig.from_recipe_name(recipe)
    cast = config.cast_config_weight
    return hp_tensor_to_float8_dynamic(weight.t(), cast.target_dtype, LinearMMConfig(),
                                       gemm_input_role=GemmInputRole.WEIGHT,
                                       scaling_granularity=cast.scaling_granularity,
                                       axiswise_dim=get_maybe_axiswise_dim(0, cast.scaling_granularity),
                                       round_scales_to_power_of_2=config.round_scales_to_power_of_2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("name", "recipe"), [("compressed-tensors-fp8-torchao-tensorwise", "tensorwise"),
                                              ("compressed-tensors-fp8-torchao-rowwise", "rowwise"),
                                              ("compressed-tensors-fp8-torchao-rowwise", "rowwise_with_gw_hp")])
def test_float8_twins_are_float8_linears_weight_cast(name, recipe, dtype):
    weight = weight_with_edges(96, 256, dtype)
    weight[0, 0] = 3.0  # a zero row's scale is torchao's 448 / 1e-12: compared too, but keep the tensor amax sane
    quantized, weight_scale = serving_format(name).quantize(weight, None, dtype)
    reference = _torchao_weight_cast(weight, recipe)
    assert torch.equal(_bytes(quantized), _bytes(reference._data.t()))
    # the factor torchao's _scaled_mm multiplies the GEMM by is the reciprocal of its scale
    expected_scale = reference._scale.reciprocal().t().reshape(weight_scale.shape)
    assert weight_scale.dtype == torch.float32
    assert torch.equal(weight_scale, expected_scale)
    if recipe != "tensorwise":
        mantissa, _ = torch.frexp(weight_scale)
        assert torch.all(mantissa == 0.5)  # rowwise scales are powers of two


def test_the_compressed_tensors_fp8_dynamic_is_not_torchaos_rowwise():
    weight = weight_with_edges(96, 256, torch.bfloat16)
    quantized, _ = serving_format("compressed-tensors-fp8-dynamic").quantize(weight, None, torch.bfloat16)
    reference = _torchao_weight_cast(weight, "rowwise")
    assert not torch.equal(_bytes(quantized), _bytes(reference._data.t()))
