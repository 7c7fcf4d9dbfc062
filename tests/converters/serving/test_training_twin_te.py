"""The TransformerEngine training twins write TE's own weight casts, bit for bit.

On a CPU: against TE's Python reference of the block-scaled cast, copied below unchanged in its arithmetic from
NVIDIA/TransformerEngine (Apache-2.0) ``tests/pytorch/references/quantize_scale_calc.py`` and
``blockwise_quantizer_reference.py`` (``_quantize_square_block_tiling``, commit d0067d0d), which TE's
``tests/pytorch/test_float8_blockwise_scaling_exact.py`` holds to its CUDA kernel with atol 0.

On a CUDA machine with TransformerEngine installed: against TE's quantizers themselves (``Float8BlockQuantizer``
with 128x128 blocks, ``MXFP8Quantizer`` rowwise), which is what ``te.Linear`` casts its weight with under
``Float8BlockScaling`` and ``MXFP8BlockScaling``. Elsewhere those tests skip and say why.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from converters.serving import serving_format
from tests.converters.serving.test_training_twin_torchao import weight_with_edges


def _te_scale_from_amax_tensor(x_dtype, amax, quant_dtype, *, eps, pow_2_scales):
    """TE's ``scale_from_amax_tensor`` (its reference of ``compute_scale_from_amax``)."""
    assert amax.dtype == torch.float, "amax must be a float tensor."
    fp8_max = torch.finfo(quant_dtype).max
    amax = torch.max(amax, torch.tensor(eps))
    scale = torch.div(fp8_max, amax)
    scale = torch.where(scale == torch.inf, torch.finfo(x_dtype).max, scale)
    if pow_2_scales:
        _, exp = torch.frexp(scale)
        exp = exp - 1
        assert (exp > -127).all()
        unity = torch.tensor([1.0], device=exp.device)
        torch.ldexp(unity, exp, out=scale)
        scale = torch.where(amax == float("inf"), 0.0, scale)
    scale = torch.where(amax == 0, 1.0, scale)
    scale_inv = torch.reciprocal(scale)
    return scale, scale_inv, amax


def _te_quantize_square_block_tiling(x, quant_dtype, tile_len, *, pow_2_scales, eps):
    """TE's ``BlockwiseQuantizerReference._quantize_square_block_tiling`` for whole tiles, without the transpose."""
    M, K = x.shape
    x_tiled = x.reshape(M // tile_len, tile_len, K // tile_len, tile_len)
    amax_grid = (torch.abs(x_tiled.transpose(-3, -2)).reshape(M // tile_len, K // tile_len, tile_len**2)
                 .amax(dim=-1)).float()
    dtype_max = torch.finfo(quant_dtype).max
    scale, scale_inv, _ = _te_scale_from_amax_tensor(x.dtype, amax_grid, quant_dtype, pow_2_scales=pow_2_scales,
                                                     eps=eps)
    qx = x_tiled * scale.reshape(M // tile_len, 1, K // tile_len, 1)
    qx = torch.clamp(qx, min=-dtype_max, max=dtype_max)
    qx = qx.to(dtype=quant_dtype)
    return qx.reshape(M, K), scale_inv


def _te_ref_per_tensor_cs_cast(tensor, quant_dtype, *, force_pow_2_scales=False, amax_epsilon=0.0):
    """TE's ``ref_per_tensor_cs_cast`` (``tests/pytorch/references/ref_per_tensor_cs.py``), rowwise output only."""
    x_fp32 = tensor.to(torch.float32)
    amax = torch.amax(torch.abs(x_fp32)).view(1)
    scale, scale_inv, _ = _te_scale_from_amax_tensor(torch.float32, amax, quant_dtype, eps=amax_epsilon,
                                                     pow_2_scales=force_pow_2_scales)
    qx = (tensor.float() * scale).to(quant_dtype)
    return qx, scale_inv


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def _block_weight(dtype: torch.dtype) -> torch.Tensor:
    """256 x 512: each 128x128 block gets rows of other magnitudes, so block amaxes cover the edge values too."""
    weight = weight_with_edges(256, 512, dtype)
    return weight[torch.randperm(256, generator=torch.Generator().manual_seed(1))].contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("name", "pow2"), [("fp8-block-te", False), ("fp8-block-ue8m0-te", True)])
def test_fp8_block_twins_are_tes_reference_cast(name, pow2, dtype):
    weight = _block_weight(dtype)
    weight[128:, :128] = 0.0  # an all-zero block: scale 1
    weight[:128, 128:256] *= 1e-37  # a block of tiny values: TE's scale is the input dtype's largest value
    quantized, scale_inv = serving_format(name).quantize(weight, None, dtype)
    reference, reference_inv = _te_quantize_square_block_tiling(weight, torch.float8_e4m3fn, 128, pow_2_scales=pow2,
                                                                eps=0.0)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (2, 4)
    assert torch.equal(scale_inv, reference_inv)
    assert torch.equal(_bytes(quantized), _bytes(reference))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_of_weight", [1.0, 1e-3, 1e-37, 0.0])
def test_current_scaling_twin_is_tes_reference_cast(dtype, scale_of_weight):
    weight = (torch.randn(96, 256, generator=torch.Generator().manual_seed(3)) * scale_of_weight).to(dtype)
    quantized, scale_inv = serving_format("compressed-tensors-fp8-te-tensorwise").quantize(weight, None, dtype)
    reference, reference_inv = _te_ref_per_tensor_cs_cast(weight, torch.float8_e4m3fn)
    assert scale_inv.dtype == torch.float32 and scale_inv.shape == (1,)
    assert torch.equal(scale_inv, reference_inv)
    assert torch.equal(_bytes(quantized), _bytes(reference))


def test_transformers_fp8_block_differs_from_te_in_last_bits():
    """Why ``fp8-block-te`` exists: ``amax / 448`` and a division is not TE's ``448 / amax`` and a product."""
    generator = torch.Generator().manual_seed(2)
    weight = (torch.randn(2048, 2048, generator=generator) * torch.rand(2048, 1, generator=generator)).bfloat16()
    ours, ours_inv = serving_format("fp8-block").quantize(weight, None, torch.bfloat16)
    te, te_inv = serving_format("fp8-block-te").quantize(weight, None, torch.bfloat16)
    assert not torch.equal(ours_inv, te_inv)
    assert not torch.equal(_bytes(ours), _bytes(te))


def test_ue8m0_equals_te_pow2_except_for_blocks_under_2_to_minus_118():
    """``fp8-block-ue8m0`` rounds ``amax / 448`` up to a power of two exactly; TE rounds ``448 / amax`` (once, in
    fp32) down: the same power for every amax, except that TE allows 2**-127 where fp8-block-ue8m0 stops at
    2**-126 (blocks whose largest value is under about 3.4e-36)."""
    weight = _block_weight(torch.bfloat16)
    ours, ours_inv = serving_format("fp8-block-ue8m0").quantize(weight, None, torch.bfloat16)
    te, te_inv = serving_format("fp8-block-ue8m0-te").quantize(weight, None, torch.bfloat16)
    assert torch.equal(ours_inv, te_inv) and torch.equal(_bytes(ours), _bytes(te))
    weight[:128, :128] = 2.0 ** -121
    _, ours_inv = serving_format("fp8-block-ue8m0").quantize(weight, None, torch.bfloat16)
    _, te_inv = serving_format("fp8-block-ue8m0-te").quantize(weight, None, torch.bfloat16)
    assert (ours_inv[0, 0].item(), te_inv[0, 0].item()) == (2.0 ** -126, 2.0 ** -127)


_TE_MISSING = "needs a CUDA GPU and TransformerEngine (transformer_engine.pytorch), which this machine does not have"


def _te_available() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(not _te_available(), reason=_TE_MISSING)
@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_block_twins_are_te_float8_block_quantizer(pow2):
    import transformer_engine.pytorch as te  # noqa: F401  (loads the extension)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer

    if not pow2 and torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("TE emulates Float8BlockScaling with MXFP8 on Blackwell: fp32 scales are Hopper only")
    weight = _block_weight(torch.bfloat16)
    quantizer = Float8BlockQuantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False,
                                     amax_epsilon=0.0, force_pow_2_scales=pow2, block_scaling_dim=2)
    cast = quantizer(weight.cuda())
    name = "fp8-block-ue8m0-te" if pow2 else "fp8-block-te"
    quantized, scale_inv = serving_format(name).quantize(weight, None, torch.bfloat16)
    assert torch.equal(cast._rowwise_data.view(torch.uint8).cpu(), _bytes(quantized))
    assert torch.equal(cast._rowwise_scale_inv.cpu()[: scale_inv.shape[0], : scale_inv.shape[1]], scale_inv)


@pytest.mark.skipif(not _te_available(), reason=_TE_MISSING)
def test_mxfp8_twin_is_te_mxfp8_quantizer():
    import transformer_engine.pytorch as te  # noqa: F401
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    if torch.cuda.get_device_capability() < (10, 0):
        pytest.skip("TE's MXFP8 casts run on Blackwell (compute capability 10.0+) only")
    weight = _block_weight(torch.bfloat16)
    cast = MXFP8Quantizer(fp8_dtype=tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)(weight.cuda())
    quantized, exponent = serving_format("mxfp8-te").quantize(weight, None, torch.bfloat16)
    assert torch.equal(cast._rowwise_data.view(torch.uint8).cpu(), _bytes(quantized))
    scales = cast._rowwise_scale_inv.view(torch.uint8).cpu()  # padded to [rows % 128, columns / 32 % 4]
    assert torch.equal(scales[: exponent.shape[0], : exponent.shape[1]], exponent)


@pytest.mark.skipif(not _te_available(), reason=_TE_MISSING)
def test_current_scaling_twin_is_te_float8_current_scaling_quantizer():
    import transformer_engine.pytorch as te  # noqa: F401
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8CurrentScalingQuantizer

    weight = _block_weight(torch.bfloat16)
    quantizer = Float8CurrentScalingQuantizer(tex.DType.kFloat8E4M3, torch.device("cuda"), rowwise=True,
                                              columnwise=False, force_pow_2_scales=False, amax_epsilon=0.0)
    cast = quantizer(weight.cuda())
    quantized, scale_inv = serving_format("compressed-tensors-fp8-te-tensorwise").quantize(weight, None,
                                                                                       torch.bfloat16)
    assert torch.equal(cast._data.view(torch.uint8).cpu(), _bytes(quantized))
    assert torch.equal(cast._scale_inv.reshape(1).cpu(), scale_inv)


@pytest.mark.parametrize(("dtype", "rcp_bits"), [(torch.bfloat16, 0x3B12), (torch.float16, 0x1892)])
def test_tes_specialized_mxfp8_kernel_picks_the_same_exponent_for_every_16_bit_amax(dtype, rcp_bits):
    """TE's cast-only MXFP8 kernel for bf16/fp16 inputs multiplies the amax by the 16-bit 1/448 (its
    ``_Quantized_Limits::max_norm_rcp``, an exact fp32 FMA of two 16-bit values); ``mxfp8-te`` follows the generic
    kernel's fp32 1/448. Over every positive finite 16-bit value, both round up to the same E8M0 exponent."""
    top = 0x7C00 if dtype is torch.float16 else 0x7F80
    amax = torch.arange(1, top, dtype=torch.int32).to(torch.int16).view(dtype)
    groups = amax.reshape(-1, 1).expand(-1, 32).contiguous()  # each value the amax of its own group
    _, exponent = serving_format("mxfp8-te").quantize(groups, None, dtype)
    product = amax.float() * torch.tensor([rcp_bits], dtype=torch.int16).view(dtype).float()
    bits = product.view(torch.int32)
    biased, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    up = (mantissa > 0) & (biased != 0xFE) & ~((biased == 0) & (mantissa <= 0x400000))
    assert torch.equal(exponent.flatten().to(torch.int32), biased + up.to(torch.int32))
