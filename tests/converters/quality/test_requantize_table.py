"""vLLM's requantization of a fused group's per-tensor FP8 shards, looked up by code: the values of its element-wise
arithmetic (``process_fp8_weight_tensor_strategy``), bit for bit, for every E4M3 code and the dtypes a pass reads."""

from __future__ import annotations

import pytest
import torch

from converters.calibration.scaling import E4M3_MAX
from converters.quality.engine_load import requantize_with_max_scale


def _vllm_elementwise(codes: torch.Tensor, scale: float, max_scale: float) -> torch.Tensor:
    dequantized = codes.to(torch.float16) * torch.tensor(scale, dtype=torch.float32)  # an fp16 product
    again = (dequantized.float() * (1.0 / torch.tensor(max_scale, dtype=torch.float32))).clamp(-E4M3_MAX, E4M3_MAX)
    return again.to(torch.float8_e4m3fn).float() * torch.tensor(max_scale, dtype=torch.float32)


@pytest.mark.parametrize(("scale", "max_scale"), [(0.01, 0.013), (1e-3, 0.5), (0.2, 0.2), (3e-5, 1e-4), (7.0, 9.5)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_requantized_weight_equals_vllm_s_elementwise_arithmetic(scale, max_scale, dtype):
    every_code = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    shuffled = torch.randint(0, 256, (300, 70), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    for codes in (every_code, shuffled.to(torch.uint8)):
        codes = codes.view(torch.float8_e4m3fn)
        expected = _vllm_elementwise(codes, scale, max_scale).to(dtype)
        got = requantize_with_max_scale(codes, scale, max_scale, dtype)
        assert got.dtype == dtype and got.shape == codes.shape
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)  # the two NaN codes stay NaN
        if scale < max_scale:  # a coarser grid: some codes move
            assert not torch.equal(got.nan_to_num(0.0), (codes.float() * scale).to(dtype).nan_to_num(0.0))
