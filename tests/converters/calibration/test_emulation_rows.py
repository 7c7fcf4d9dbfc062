"""fake_quantize with one scale or amax per row: rows gathered from several tensors cast as each tensor would."""

from __future__ import annotations

import pytest
import torch

from converters.casts.emulation import (
    SPEC_NAMES,
    cast_spec,
    fake_quantize,
    fake_quantize_factored,
    fake_quantize_per_tensor,
    tensor_scale,
)


def _two_tensors():
    generator = torch.Generator().manual_seed(0)
    return torch.randn(8, 64, generator=generator), torch.randn(5, 64, generator=generator) * 40


@pytest.mark.parametrize("spec_name", ["e4m3_tensor", "e5m2_tensor", "nvfp4_block16"])
def test_per_row_amax_casts_each_row_as_its_own_tensor(spec_name):
    spec = cast_spec(spec_name)
    first, second = _two_tensors()
    amax = [first.abs().amax(), second.abs().amax()]
    one_by_one = torch.cat([fake_quantize(t, spec, tensor_amax=a) for t, a in zip((first, second), amax, strict=True)])
    per_row = torch.cat([amax[0].expand(8), amax[1].expand(5)])
    assert torch.equal(fake_quantize(torch.cat([first, second]), spec, tensor_amax=per_row), one_by_one)


def test_per_row_scale_casts_each_row_with_its_given_scale():
    spec = cast_spec("e4m3_tensor")
    first, second = _two_tensors()
    scales = [tensor_scale(torch.tensor(3.0), 448.0), tensor_scale(torch.tensor(90.0), 448.0)]
    one_by_one = torch.cat([fake_quantize(t, spec, scale=s) for t, s in zip((first, second), scales, strict=True)])
    per_row = torch.cat([scales[0].expand(8), scales[1].expand(5)])
    assert torch.equal(fake_quantize(torch.cat([first, second]), spec, scale=per_row), one_by_one)


def test_per_row_values_are_refused_where_rows_share_blocks_or_miscount():
    first, _ = _two_tensors()
    with pytest.raises(ValueError, match="one per row"):
        fake_quantize(first, cast_spec("e4m3_tensor"), tensor_amax=torch.ones(3))
    with pytest.raises(ValueError, match="16-row blocks"):
        fake_quantize(first.repeat(2, 1), cast_spec("nvfp4_block16x16"), tensor_amax=torch.ones(16))


@pytest.mark.parametrize("library", ["te", "torchao"])
@pytest.mark.parametrize("spec_name", sorted(SPEC_NAMES))
def test_a_factored_cast_is_exact_in_bf16_and_multiplies_back_to_the_cast(spec_name, library):
    """values * factor is fake_quantize's result (to two fp32 roundings), and values survive a round trip through
    bf16 unchanged: an emulated GEMM can multiply them in bf16 and scale its output."""
    spec = cast_spec(spec_name, library=library)
    if spec.element == "e2m1" and library == "torchao":
        pytest.skip("NVFP4 follows TE's arithmetic only")
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 256, generator=generator) * torch.logspace(-3, 2, 256)
    values, factor = fake_quantize_factored(x, spec)
    assert torch.equal(values.bfloat16().float(), values)
    product = values if factor is None else values * factor
    torch.testing.assert_close(product, fake_quantize(x, spec), rtol=2**-22, atol=0)  # NVFP4 reassociates: 2 roundings


def test_fp32_scaled_blocks_along_a_row_have_no_factor_to_take_out():
    spec = cast_spec("e4m3_block_1x128", pow2_scales=False)
    assert fake_quantize_factored(torch.randn(4, 256), spec) is None


@pytest.mark.parametrize("library", ["te", "torchao"])
@pytest.mark.parametrize("spec_name", ["e4m3_tensor", "e5m2_tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pow2", [False, True])
def test_the_per_tensor_table_cast_is_bitwise_the_element_wise_one(library, spec_name, dtype, pow2):
    """``fake_quantize_per_tensor`` reads each code's value from a table of the 256: the bits of ``fake_quantize``
    rounded to ``dtype``, saturated values, zeros and an input in any float dtype included."""
    spec = cast_spec(spec_name, library=library, pow2_scales=pow2)
    x = (torch.randn(48, 64, generator=torch.Generator().manual_seed(3)) * 5).to(dtype)
    x[0, :4] = torch.tensor([0.0, -0.0, 1e4, -1e4], dtype=dtype)
    top = 448.0 if spec_name.startswith("e4m3") else 57344.0
    for scale in (tensor_scale(x.float().abs().amax(), top, library=library, pow2=pow2),
                  torch.tensor(top / 3.0)):  # the tensor's own scale, and one that saturates the outliers
        expected = fake_quantize(x.float(), spec, scale=scale).to(dtype)
        got = fake_quantize_per_tensor(x, spec, scale, dtype)
        out = torch.empty_like(x)
        fake_quantize_per_tensor(x, spec, scale, dtype, out=out)
        bits = {2: torch.int16, 4: torch.int32}[expected.element_size()]
        assert torch.equal(got.view(bits), expected.view(bits)) and torch.equal(out.view(bits), expected.view(bits))
    with pytest.raises(ValueError, match="not a per-tensor FP8 cast"):
        fake_quantize_per_tensor(x, cast_spec("e4m3_row"), torch.tensor(1.0), dtype)


@pytest.mark.parametrize("library", ["te", "torchao"])
@pytest.mark.parametrize("spec_name", ["e4m3_tensor", "e5m2_tensor", "e4m3_row"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_factored_values_in_bf16_from_any_input_dtype_are_the_fp32_ones(library, spec_name, dtype):
    """The meter's bf16 GEMM reads the FP8 values in bf16 straight from the codes, cast from the layer's own (half)
    tensor: the same values and factor as the fp32 path on the upcast tensor, saturation included."""
    spec = cast_spec(spec_name, library=library)
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(32, 128, generator=generator) * torch.logspace(-2, 2, 128)).to(dtype)
    given = None if spec.block[0] == 1 else torch.tensor(3.5)  # a fixed per-tensor scale saturates the largest
    want_values, want_factor = fake_quantize_factored(x.float(), spec, scale=given)
    values, factor = fake_quantize_factored(x, spec, scale=given, values_dtype=torch.bfloat16)
    assert values.dtype == torch.bfloat16
    assert torch.equal(values.float(), want_values) and torch.equal(factor, want_factor)
