"""NVFP4 block scales searched by reconstruction error ("mse"): never worse than round to nearest, block by block,
read back by compressed-tensors' own decompressor; round to nearest unchanged."""

from __future__ import annotations

import pytest
import torch

from converters.serving.nvfp4 import (
    GROUP,
    NVFP4,
    NVFP4_A16,
    SCALE_SEARCHES,
    block_errors,
    quantize_nvfp4,
    rtn_block_scales,
)


def trained_like_weight(rows: int = 96, columns: int = 256, seed: int = 0) -> torch.Tensor:
    """Gaussian rows of different widths with a few outlier columns, as trained Linears have (bf16)."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, columns, generator=generator) * torch.rand(rows, 1, generator=generator) * 0.05
    weight[:, torch.randint(0, columns, (4,), generator=generator)] *= 12
    weight[0, :GROUP] = 0  # an all-zero block keeps E4M3's eps scale
    return weight.to(torch.bfloat16)


def decompressed(weight: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, gparam: torch.Tensor
                 ) -> torch.Tensor:
    """The weight compressed-tensors reads back from the written tensors (fp32)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("NVFP4", ["Linear"])
    state = {"weight_packed": packed, "weight_scale": scale, "weight_global_scale": gparam,
             "weight_shape": torch.tensor(weight.shape)}
    return NVFP4PackedCompressor.decompress(state, scheme)["weight"].float()


@pytest.mark.parametrize("seed", [0, 1])
def test_searched_scales_never_lose_to_round_to_nearest_in_any_block(seed):
    weight = trained_like_weight(seed=seed)
    amax = float(weight.float().abs().amax())
    rtn = quantize_nvfp4(weight, amax)
    mse = quantize_nvfp4(weight, amax, scale_search="mse")
    assert torch.equal(rtn[2], mse[2])  # the global scale is round to nearest's: fused groups still share it
    blocks = weight.unflatten(-1, (weight.shape[1] // GROUP, GROUP))
    rtn_error = block_errors(blocks, rtn[1].float(), rtn[2])
    mse_error = block_errors(blocks, mse[1].float(), mse[2])
    assert bool((mse_error <= rtn_error).all())
    changed = mse[1].view(torch.uint8) != rtn[1].view(torch.uint8)
    assert bool((mse_error[changed] < rtn_error[changed]).all())  # a block changes its scale only to gain
    # measured: 0.90-0.93 of RTN's error in total (the outlier blocks dominate it), 0.82 block by block on average
    assert float(mse_error.sum()) < 0.96 * float(rtn_error.sum())
    nonzero = rtn_error > 0
    assert float((mse_error[nonzero] / rtn_error[nonzero]).mean()) < 0.9
    # what an engine reads back is what the search measured: compressed-tensors' own decompression
    for (packed, scale, gparam), error in ((rtn, rtn_error), (mse, mse_error)):
        read_back = decompressed(weight, packed, scale, gparam)
        measured = (read_back - weight.float()).square().sum()
        # compressed-tensors rounds its dequantized weight to the model's bf16: 0.1% here
        assert torch.allclose(measured, error.sum(), rtol=1e-2)


def test_the_four_over_six_scale_is_chosen_where_it_is_exact_and_better():
    # values at 4.4/6 of the block's amax: round to nearest maps them to 4 (error 0.4 each); with the amax mapped
    # to 4 they sit at 2.93, one 3 away (error 0.07 in those units): the 4-scale wins
    block = torch.tensor([6.0] + [4.4] * 15)
    weight = torch.stack([block, block / 8]).repeat(1, 2).to(torch.bfloat16) * 0.01
    amax = 0.5  # well above the blocks, so the 4-scale fits E4M3
    packed, scale, gparam = quantize_nvfp4(weight, amax, scale_search="mse")
    blocks = weight.unflatten(-1, (weight.shape[1] // GROUP, GROUP))
    four = (gparam * blocks.abs().amax(-1).float() / 4).to(torch.float8_e4m3fn).float()
    assert torch.equal(scale.float(), four)
    assert float(block_errors(blocks, scale.float(), gparam).sum()) < \
        float(block_errors(blocks, rtn_block_scales(blocks, gparam), gparam).sum())


def test_a_block_whose_larger_scale_would_overflow_e4m3_keeps_the_range_it_has():
    weight = trained_like_weight(8, 64)
    amax = float(weight.float().abs().amax())  # the largest block's RTN scale is 448, E4M3's largest
    _, scale, _ = quantize_nvfp4(weight, amax, scale_search="mse")
    assert float(scale.float().max()) <= 448 and not bool(scale.float().isnan().any())


def test_round_to_nearest_is_the_default_and_an_unknown_search_is_refused():
    weight = trained_like_weight(16, 64)
    amax = float(weight.float().abs().amax())
    default, explicit = quantize_nvfp4(weight, amax), quantize_nvfp4(weight, amax, scale_search="rtn")
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
               for a, b in zip(default, explicit, strict=True))
    assert NVFP4.scale_search == "rtn" and SCALE_SEARCHES == ("rtn", "mse", "four_over_six")
    with pytest.raises(ValueError, match="scale_search must be one of rtn, mse, four_over_six, got 'gptq'"):
        quantize_nvfp4(weight, amax, scale_search="gptq")
    with pytest.raises(ValueError, match="scale_search must be one of"):
        NVFP4.with_scale_search("MSE")


@pytest.mark.parametrize("base", [NVFP4, NVFP4_A16])
def test_a_searched_format_writes_the_same_tensors_and_reports_both_errors(base):
    searched = base.with_scale_search("mse")
    assert (searched.name, searched.activations) == (base.name, base.activations)
    weight = trained_like_weight(32, 128)
    amax = float(weight.float().abs().amax()) * 1.25  # a fused group's amax
    tensors = searched.quantize(weight, 3.0, torch.bfloat16, weight_amax=amax)
    plain = base.quantize(weight, 3.0, torch.bfloat16, weight_amax=amax)
    assert [(t.dtype, t.shape) for t in tensors] == [(t.dtype, t.shape) for t in plain]
    stats = searched.layer_stats(weight, tensors)
    assert stats["scale_search"] == "mse" and 0 < stats["searched_blocks_changed"] <= 1
    assert stats["weight_sqnr_db"] > stats["rtn_weight_sqnr_db"]
    config = searched.quantization_config(_EmptyPlan())["config_groups"]["group_0"]
    assert config["weights"]["observer"] == "memoryless_mse"
    assert base.quantization_config(_EmptyPlan())["config_groups"]["group_0"]["weights"]["observer"] == \
        "memoryless_minmax"


class _EmptyPlan:
    """What quantization_config reads of a plan: nothing kept in high precision."""

    linear_paths: tuple = ()
    quantized: dict = {}
    unquantized_experts: dict = {}
    router_gates: tuple = ()


@pytest.mark.parametrize("seed", [0, 1])
def test_four_over_six_takes_per_block_the_6_or_the_4_scale_whichever_errs_less(seed):
    weight = trained_like_weight(seed=seed)
    amax = float(weight.float().abs().amax())
    rtn = quantize_nvfp4(weight, amax)
    four = quantize_nvfp4(weight, amax, scale_search="four_over_six")
    assert torch.equal(rtn[2], four[2])
    blocks = weight.unflatten(-1, (weight.shape[1] // GROUP, GROUP))
    four_scale = (four[2] * (blocks.abs().amax(dim=-1).float() / 4)).to(torch.float8_e4m3fn)
    written, rtn_scale = four[1].view(torch.uint8), rtn[1].view(torch.uint8)
    changed = written != rtn_scale
    assert bool(changed.any()) and torch.equal(written[changed], four_scale.view(torch.uint8)[changed])
    rtn_error = block_errors(blocks, rtn[1].float(), rtn[2])
    four_error = block_errors(blocks, four[1].float(), four[2])
    assert bool((four_error[changed] < rtn_error[changed]).all()) and bool((four_error <= rtn_error).all())
    # mse's candidates hold the 4-scale: its error is never larger than four_over_six's in total
    mse = quantize_nvfp4(weight, amax, scale_search="mse")
    assert float(block_errors(blocks, mse[1].float(), mse[2]).sum()) <= float(four_error.sum())
