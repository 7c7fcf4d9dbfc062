"""The report's FP8 Linear against the arithmetic vLLM's CPU build executes for the same export.

What the engine runs was counted in vLLM itself (docs/engines.md, "What the CPU build executes"): static per-tensor
exports go through ``PerTensorTorchFP8ScaledMMLinearKernel`` (``QuantFP8.forward_native``: ``x.float() *
scale.reciprocal()``, cast to E4M3; then ``torch._scaled_mm`` with both scales), per-token dynamic ones through
``ChannelWiseTorchFP8ScaledMMLinearKernel`` (each token's amax / 448, floored at 1 / (448 * 512); ``_scaled_mm`` in
fp32 with unit scales, then ``* x_scale * w_scale.t()``). The same arithmetic is written out here with torch's own
``_scaled_mm`` and compared with the quality pass's Linear (``casting_linears`` over a weight read back from its
codes), in fp32 as the pass computes on a CPU without native bf16 dot products.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from converters.casts.emulation import cast_spec, fake_quantize
from converters.quality import LayerCast, casting_linears

E4M3_MAX = 448.0


def _layer(codes: torch.Tensor) -> nn.Module:
    model = nn.Sequential()
    model.add_module("proj", nn.Linear(codes.shape[1], codes.shape[0], bias=False))
    return model


def _codes(rows: int, columns: int, generator: torch.Generator) -> torch.Tensor:
    return (torch.randn(rows, columns, generator=generator) * 100).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _engine_quant(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """vLLM's ``QuantFP8.forward_native`` for a given scale (per tensor or per token)."""
    return (x.to(torch.float32) * scale.to(torch.float32).reciprocal()).clamp(-E4M3_MAX, E4M3_MAX) \
        .to(torch.float8_e4m3fn)


def test_static_per_tensor_linear_is_the_engines_scaled_mm():
    generator = torch.Generator().manual_seed(0)
    codes, weight_scale = _codes(48, 64, generator), torch.tensor([0.0031])
    input_scale = torch.tensor([0.0123])  # as stored: amax / 448
    x = torch.randn(2, 16, 64, generator=generator) * 2
    x[0, 0, 0] = 40.0  # beyond the calibrated range: saturates at 448 in both
    cast = LayerCast(read_weight=lambda dtype: (codes.float() * weight_scale).to(dtype),
                     input=cast_spec("e4m3_tensor"), input_scale=1.0 / float(input_scale))
    model = _layer(codes)
    with torch.no_grad(), casting_linears(model, {"proj": cast}):
        ours = model.proj(x)
    flat = x.reshape(-1, 64)
    engine = torch._scaled_mm(_engine_quant(flat, input_scale), codes.t(), scale_a=input_scale,
                              scale_b=weight_scale, out_dtype=torch.float32).reshape(ours.shape)
    torch.testing.assert_close(ours, engine, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("zero_row", [False, True])
def test_dynamic_per_token_linear_is_the_engines_channel_wise_kernel(zero_row):
    generator = torch.Generator().manual_seed(1)
    codes = _codes(40, 64, generator)
    weight_scale = torch.rand(40, 1, generator=generator) * 0.01 + 0.001  # per output channel
    x = torch.randn(24, 64, generator=generator) * torch.logspace(-2, 1, 24).unsqueeze(1)
    if zero_row:
        x[3] = 0.0  # the engine floors the scale at 1 / (448 * 512); a zero row stays zero either way
    cast = LayerCast(read_weight=lambda dtype: (codes.float() * weight_scale).to(dtype),
                     input=cast_spec("e4m3_row", library="vllm"))
    model = _layer(codes)
    with torch.no_grad(), casting_linears(model, {"proj": cast}):
        ours = model.proj(x)
    x_scale = (x.abs().amax(dim=-1, keepdim=True).float() / E4M3_MAX).clamp(min=1.0 / (E4M3_MAX * 512.0))
    ones = torch.ones(1)
    engine = torch._scaled_mm(_engine_quant(x, x_scale), codes.t(), scale_a=ones, scale_b=ones,
                              out_dtype=torch.float32) * x_scale * weight_scale.t()
    torch.testing.assert_close(ours, engine, rtol=1e-5, atol=1e-6)


def test_the_dynamic_exports_input_cast_is_vllms_to_the_bit():
    # bf16 activations (8-bit mantissas) often sit on an E4M3 rounding midpoint, where the multiplier's last bit
    # decides the code: vLLM multiplies by (amax / 448).reciprocal(), TE by 448 / amax
    generator = torch.Generator().manual_seed(2)
    x = (torch.randn(4096, 64, generator=generator) * torch.logspace(-3, 2, 4096).unsqueeze(1)).bfloat16().float()
    x_scale = (x.abs().amax(dim=-1, keepdim=True) / E4M3_MAX).clamp(min=1.0 / (E4M3_MAX * 512.0))
    engine = _engine_quant(x, x_scale).float() * x_scale
    assert torch.equal(fake_quantize(x, cast_spec("e4m3_row", library="vllm")), engine)
    assert not torch.equal(fake_quantize(x, cast_spec("e4m3_row", library="te")), engine)  # the check can fail
