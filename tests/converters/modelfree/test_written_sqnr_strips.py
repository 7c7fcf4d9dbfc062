"""The written SQNR's decoding shortcuts read every code as the checkpoint readers do, and its strip sums match fp64
sums over the whole weight for every scale layout, on weights of several strips (the last one partial)."""

from __future__ import annotations

import pytest
import torch

from converters.casts.emulation import db
from converters.model.quantized.arithmetic import E2M1_CODES, dequantize_fp8, dequantize_nvfp4
from converters.serving import written_sqnr
from converters.serving.written_sqnr import written_weight_sqnr


def test_every_finite_e4m3_code_reads_as_its_value_over_256():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    read = written_sqnr._fp8_over_256(codes, {}).float() * 256
    finite = ~codes.float().isnan()
    assert int(finite.sum()) == 254
    assert torch.equal(read[finite], codes.float()[finite])  # -0 included: equal compares values, so check the sign
    assert torch.equal(read[finite].signbit(), codes.float()[finite].signbit())


def test_the_nvfp4_pair_table_holds_each_bytes_two_codes_low_nibble_first():
    pairs = written_sqnr._e2m1_pairs(torch.device("cpu")).view(torch.float16).view(256, 2).float()
    byte = torch.arange(256)
    table = torch.tensor(E2M1_CODES)
    assert torch.equal(pairs[:, 0], table[byte & 0x0F]) and torch.equal(pairs[:, 1], table[byte >> 4])
    assert torch.equal(pairs.signbit(), torch.stack((table[byte & 0x0F], table[byte >> 4]), -1).signbit())


def _weight(rows: int, columns: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    spread = torch.exp(torch.randn(rows, 1, generator=generator) * 2)
    weight = torch.randn(rows, columns, generator=generator) * 0.02 * spread
    weight[::7, ::5] = 0.0  # zeros, and values small enough to give subnormal E4M3 codes
    weight[1::11, 3::13] *= 1e-3
    return weight.to(torch.bfloat16)


def _fp8_written(weight: torch.Tensor, layout: str) -> dict[str, torch.Tensor]:
    rows, columns = weight.shape
    w = weight.float()
    if layout == "tensor":
        scale = (w.abs().amax() / 448).reshape(1)
        expanded = scale
    elif layout == "row":
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        expanded = scale
    elif layout == "mx":  # biased E8M0 exponents of groups of 32
        exponent = torch.floor(torch.log2(w.view(rows, -1, 32).abs().amax(-1).clamp(min=2.0 ** -100))) - 8
        scale = (exponent + 127).to(torch.uint8)
        expanded = torch.exp2(exponent).repeat_interleave(32, dim=1)
    else:  # 128x128 blocks
        scale = w.view(rows // 128, 128, columns // 128, 128).abs().amax(dim=(1, 3)) / 448
        expanded = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    expanded = torch.where(expanded == 0, torch.ones_like(expanded), expanded)
    codes = (w / expanded).clamp(-448, 448).to(torch.float8_e4m3fn)
    if layout != "mx":
        scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    return {"weight": codes, "weight_scale": scale}


def _reference(weight: torch.Tensor, written: dict[str, torch.Tensor]) -> float:
    tensors = list(written.values())
    if tensors[0].dtype == torch.uint8:
        dequantized = dequantize_nvfp4(*tensors[:3], torch.float32, divide=list(written)[2].endswith("global_scale"))
    else:
        block = (128, 128) if tensors[1].dim() == 2 and tensors[1].shape[0] != weight.shape[0] else None
        dequantized = dequantize_fp8(tensors[0], tensors[1], torch.float32, block)
    source = weight.double()
    return db(float(source.square().sum()), float((dequantized.double() - source).square().sum()))


# 640 x 1024: strips of 256 rows, the last of 128; 1280 x 512 for the 128-row blocks: strips of 512 rows, the last 256
@pytest.mark.parametrize("layout,shape", [("tensor", (640, 1024)), ("row", (640, 1024)), ("mx", (640, 1024)),
                                          ("block", (1280, 512))])
def test_fp8_strip_sums_match_fp64_over_the_whole_weight(layout, shape):
    weight = _weight(*shape)
    written = _fp8_written(weight, layout)
    assert weight.numel() > written_sqnr._STRIP_ELEMENTS
    assert written_weight_sqnr(weight, written) == pytest.approx(_reference(weight, written), abs=1e-3)


@pytest.mark.parametrize("divide", [True, False])
def test_nvfp4_strip_sums_match_fp64_over_the_whole_weight(divide):
    weight = _weight(640, 1024)
    generator = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (640, 512), dtype=torch.uint8, generator=generator)
    block_scale = (torch.rand(640, 64, generator=generator) * 0.5 + 0.01).to(torch.float8_e4m3fn)
    tensor_scale = torch.tensor([0.37 if divide else 1.3])
    names = ["weight_packed", "weight_scale", "weight_global_scale" if divide else "weight_scale_2"]
    written = dict(zip(names, [packed, block_scale, tensor_scale], strict=True))
    # random codes: a noisy weight, whose SQNR still has to be read exactly
    assert written_weight_sqnr(weight, written) == pytest.approx(_reference(weight, written), abs=1e-3)


def test_an_exact_cast_reports_the_cap_and_an_empty_weight_none():
    weight = torch.tensor([[1.0, -2.0, 0.5, 448.0]] * 4, dtype=torch.bfloat16)
    written = {"weight": weight.float().to(torch.float8_e4m3fn), "weight_scale": torch.ones(1)}
    assert written_weight_sqnr(weight, written) == 300.0
    empty = torch.zeros(0, 4, dtype=torch.bfloat16)
    assert written_weight_sqnr(empty, {"weight": empty.to(torch.float8_e4m3fn), "weight_scale": torch.ones(1)}) is None
