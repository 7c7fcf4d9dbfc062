"""Per-layer quantization error: the emulated casts against direct computations and torchao's own casts, SQNR
on a tensor with an outlier, the incremental meter, and low_sqnr exclusion in a real conversion."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from converters.calibration.sensitivity import meter_for, recipe_casts
from converters.casts.emulation import (
    E2M1_GRID,
    SQNR_CAP_DB,
    ScaleRule,
    cast_spec,
    db,
    e8m0_exponent,
    fake_quantize,
    nvfp4_global_scale,
    round_to_e2m1,
)
from converters.errors import RecipeError, RequestError
from converters.pipeline.request import CalibrationSettings, ConversionRequest
from converters.recipes import TECurrentScalingRecipe, TEDelayedScalingRecipe, TorchAORecipe
from converters.recipes.presets import parse_compare_recipe


def sqnr(x: torch.Tensor, q: torch.Tensor) -> float:
    return db(float(x.square().sum()), float((x - q).square().sum()))


# --- the casts, by hand -----------------------------------------------------------------------------


def test_e4m3_per_tensor_cast_is_exact_on_its_grid_and_rounds_ties_to_even():
    # amax 448 gives scale 1: E4M3 values come back exactly; the midpoints 1.0625 (between 1 and 1.125) and
    # 1.1875 (between 1.125 and 1.25) go to the even mantissa: 1.0 and 1.25.
    grid = torch.tensor([[448.0, -240.0, 1.0, 0.015625, 0.001953125, -3.5]])
    assert torch.equal(fake_quantize(grid, cast_spec("e4m3_tensor")), grid)
    assert sqnr(grid, fake_quantize(grid, cast_spec("e4m3_tensor"))) == SQNR_CAP_DB
    ties = torch.tensor([[448.0, 1.0625, 1.1875]])
    assert fake_quantize(ties, cast_spec("e4m3_tensor")).tolist() == [[448.0, 1.0, 1.25]]


def test_e4m3_per_tensor_scale_and_saturation_follow_te():
    x = torch.tensor([[3.0, 1.0, -0.3]])
    scale = torch.tensor(448.0) / torch.tensor(3.0)  # TE: fp8_max / amax in fp32, dequantized by 1 / scale
    expected = (x * scale).to(torch.float8_e4m3fn).float() * (1.0 / scale)
    assert torch.equal(fake_quantize(x, cast_spec("e4m3_tensor")), expected)
    # a given scale (delayed scaling) that is too large saturates at 448 instead of overflowing
    assert fake_quantize(x, cast_spec("e4m3_tensor"), scale=448.0)[0, 0] == 1.0  # 3 * 448 -> 448, / 448
    assert fake_quantize(torch.tensor([[1000.0]]), cast_spec("e4m3_tensor"), scale=1.0).item() == 448.0


def test_e5m2_per_tensor_rounds_to_its_two_bit_mantissa():
    x = torch.tensor([[57344.0, 1.125, 1.375, 1.3]])  # ties 1.125 -> 1.0, 1.375 -> 1.5; 1.3 -> 1.25
    assert fake_quantize(x, cast_spec("e5m2_tensor")).tolist() == [[57344.0, 1.0, 1.5, 1.25]]


def test_mxfp8_block_exponent_on_a_hand_made_block():
    # amax 1.9: RCEIL (TE, torchao training) 2**ceil(log2(1.9 / 448)) = 2**-7 -> biased 120, nothing saturates;
    # FLOOR (OCP MX) 2**(floor(log2 1.9) - 8) = 2**-8 -> biased 119, and 1.9 / 2**-8 = 486 saturates at 448.
    block = torch.zeros(1, 32)
    block[0, :4] = torch.tensor([1.9, -0.5, 0.01, 1e-6])
    amax = block.abs().amax(dim=1)
    assert e8m0_exponent(amax).item() == 127 - 7
    assert e8m0_exponent(amax, library="torchao").item() == 127 - 7
    assert e8m0_exponent(amax, rule=ScaleRule.E8M0_FLOOR).item() == 127 - 8
    rceil = fake_quantize(block, cast_spec("mxfp8_e4m3_block32"))
    # 1.9 * 2**7 = 243.2 -> E4M3 240 (step 16 in [128, 256)); 0.01 * 128 = 1.28 -> 1.25; 1e-6 * 128 underflows
    assert rceil[0, :4].tolist() == [240 / 128, -0.5, 1.25 / 128, 0.0]
    floor = fake_quantize(block, cast_spec("mxfp8_e4m3_block32", mx_rounding="floor"))
    assert floor[0, 0].item() == 448 / 256  # saturated
    assert torch.equal(fake_quantize(torch.zeros(2, 32), cast_spec("mxfp8_e4m3_block32")), torch.zeros(2, 32))


def test_mxfp8_scales_are_per_32_values_along_k():
    x = torch.ones(2, 64)
    x[0, 40] = 1000.0  # only the second block of row 0 changes scale
    q = fake_quantize(x, cast_spec("mxfp8_e4m3_block32"))
    assert torch.equal(q[0, :32], torch.ones(32)) and torch.equal(q[1], torch.ones(64))
    assert q[0, 40].item() == 1024.0  # 1000 * 2**-2 = 250 -> 256 in E4M3 (step 16), times 4


@pytest.mark.parametrize("mode", ["rceil", "floor"])
def test_mxfp8_matches_torchao_to_mx_bitwise(mode):
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import get_fp_scale, to_mx

    torch.manual_seed(0)
    x = torch.randn(16, 256) * torch.logspace(-3, 3, 16).unsqueeze(1)
    x[3, 5] = 448.0 * 4  # an amax on a power-of-two boundary
    scale, data = to_mx(x, torch.float8_e4m3fn, 32, scaling_mode=ScaleCalculationMode(mode))
    expected = (data.float().reshape(16, 8, 32) * get_fp_scale(scale).reshape(16, 8, 1)).reshape(16, 256)
    for library in (("te", "torchao") if mode == "rceil" else ("torchao",)):
        ours = fake_quantize(x, cast_spec("mxfp8_e4m3_block32", mx_rounding=mode, library=library))
        assert torch.equal(ours, expected), library


def test_nvfp4_two_level_scale_on_a_hand_made_tensor():
    # Two blocks of 16. Global amax 6: S_enc = 448 * 6 / 6 = 448. Block A (amax 6): decode scale
    # e4m3(6 * 448 / 6) = 448, i.e. 1.0 after the global one; block B (amax 1): e4m3(1 * 448 / 6 = 74.67) = 72,
    # i.e. 72/448, so B's values are divided by 0.1607 before E2M1 and 1.0 itself saturates to 6.
    x = torch.zeros(1, 32)
    x[0, :4] = torch.tensor([6.0, 2.6, -0.3, 0.2])
    x[0, 16:20] = torch.tensor([1.0, -0.5, 0.25, 0.04])
    assert nvfp4_global_scale(x.abs().amax()).item() == 448.0
    q = fake_quantize(x, cast_spec("nvfp4_block16"))  # dequantized with fp32 arithmetic: to within 1e-6
    assert q[0, :4].tolist() == pytest.approx([6.0, 3.0, -0.5, 0.0], rel=1e-6)  # 2.6 -> 3, 0.3 -> 0.5, 0.2 -> 0
    step = 72 / 448
    expected = [6 * step, -3 * step, 1.5 * step, 0.0]  # 0.5/step = 3.11 -> 3; 0.25/step = 1.56 -> 1.5; 0.04 -> 0
    assert q[0, 16:20].tolist() == pytest.approx(expected, rel=1e-6)
    assert torch.equal(fake_quantize(torch.zeros(1, 16), cast_spec("nvfp4_block16")), torch.zeros(1, 16))


def test_nvfp4_matches_torchao_two_level_nvfp4_quantize():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale

    torch.manual_seed(1)
    x = torch.randn(32, 128) * torch.rand(32, 1) * 10
    global_scale = per_tensor_amax_to_scale(x.abs().amax())
    block_scales, packed = nvfp4_quantize(x, 16, global_scale)
    values = f4_unpacked_to_f32(unpack_uint4(packed)).reshape(32, 8, 16)
    expected = (values * block_scales.float().reshape(32, 8, 1) * global_scale).reshape(32, 128)
    # the same E4M3 block scales and E2M1 values; TE's and torchao's fp32 dequantization differ in the last bit
    assert torch.allclose(fake_quantize(x, cast_spec("nvfp4_block16")), expected, rtol=2**-21, atol=0)


def test_e2m1_rounds_to_nearest_even_on_its_grid():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -2.5, 7.0, -100.0])
    assert round_to_e2m1(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -2.0, 6.0, -6.0]
    assert round_to_e2m1(torch.tensor(E2M1_GRID)).tolist() == list(E2M1_GRID)
    sweep = torch.linspace(-7, 7, 5601)
    assert torch.equal(round_to_e2m1(sweep), f4_unpacked_to_f32(f32_to_f4_unpacked(sweep)))


@pytest.mark.parametrize("name, pow2", [("e4m3_tensor", False), ("e4m3_row", True)])
def test_torchao_casts_match_torchao_float8_bitwise(name, pow2):
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig

    torch.manual_seed(2)
    x = torch.randn(64, 96) * torch.logspace(-2, 2, 64).unsqueeze(1)
    granularity = ScalingGranularity.AXISWISE if name == "e4m3_row" else ScalingGranularity.TENSORWISE
    cast = hp_tensor_to_float8_dynamic(x, torch.float8_e4m3fn, LinearMMConfig(), scaling_granularity=granularity,
                                       axiswise_dim=-1 if pow2 else None, round_scales_to_power_of_2=pow2)
    assert torch.equal(fake_quantize(x, cast_spec(name, library="torchao", pow2_scales=pow2)),
                       cast.to_original_precision())


def test_two_dimensional_blocks_share_one_scale():
    # TE's 2-D weight blocks, NVFP4 16x16 (its default for weights) and MXFP8 32x32 (enable_2d_quantization):
    # a large value in row 0 changes the scale of the rows below it in its block, which 1-D blocks leave alone.
    x = torch.full((32, 64), 0.5)
    x[31, 63] = 6.0  # holds the global amax (NVFP4's fp32 scale) in both tensors
    y = x.clone()
    y[0, 0] = 5.0
    for name, changes in (("nvfp4_block16x16", True), ("nvfp4_block16", False)):
        qx, qy = fake_quantize(x, cast_spec(name)), fake_quantize(y, cast_spec(name))
        assert torch.equal(qx[1:16, :16], qy[1:16, :16]) != changes, name
        assert torch.equal(qx[16:, :], qy[16:, :]) and torch.equal(qx[:, 16:], qy[:, 16:]), name
    x = torch.full((64, 64), 1.1)  # 1.125 in E4M3 at any power-of-two scale, unless it lands in the subnormals
    x[0, 0] = 1e5  # scale 2**8: 1.1 / 256 is subnormal in E4M3 and comes back as 1.0
    two_d = fake_quantize(x, cast_spec("mxfp8_e4m3_block32x32"))
    assert (two_d[1:32, :32] == 1.0).all() and (two_d[32:, :] == 1.125).all() and (two_d[:, 32:] == 1.125).all()
    one_d = fake_quantize(x, cast_spec("mxfp8_e4m3_block32"))
    assert (one_d[0, 1:32] == 1.0).all() and (one_d[1:, :] == 1.125).all()


def test_block_casts_scale_each_block_and_pad_the_edges():
    x = torch.ones(130, 130)
    x[0, 0] = 2.0**10  # one 128x128 block (and one 1x128 row block) holds it
    q = fake_quantize(x, cast_spec("e4m3_block_128x128"))
    assert q.shape == (130, 130) and torch.equal(q[128:, :], x[128:, :]) and torch.equal(q[:, 128:], x[:, 128:])
    rows = fake_quantize(x, cast_spec("e4m3_block_1x128"))
    assert torch.equal(rows[1:], x[1:]) and rows[0, 0] == 2.0**10


# --- SQNR -----------------------------------------------------------------------------------------------


def test_sqnr_orders_per_tensor_below_128x128_below_mxfp8_on_a_tensor_with_an_outlier():
    # One outlier 2**16 above the rest, in the first 128x128 block. The outlier casts exactly under all three
    # (448 * 2**k), so the noise is the small values' alone, which is what granularity changes: per tensor every
    # small value falls into E4M3's subnormals; with 128x128 blocks only those sharing the outlier's block; with
    # MXFP8 only the 31 sharing its 32-value block.
    torch.manual_seed(3)
    x = torch.randn(256, 256)
    x[0, 0] = 448.0 * 2**9
    per_tensor = sqnr(x, fake_quantize(x, cast_spec("e4m3_tensor")))
    block = sqnr(x, fake_quantize(x, cast_spec("e4m3_block_128x128")))
    mxfp8 = sqnr(x, fake_quantize(x, cast_spec("mxfp8_e4m3_block32")))
    assert per_tensor + 3 < block and block + 3 < mxfp8, (per_tensor, block, mxfp8)
    nvfp4 = sqnr(x, fake_quantize(x, cast_spec("nvfp4_block16")))
    assert nvfp4 < mxfp8


def test_fp8_sqnr_of_a_gaussian_is_about_31_db_and_fp4_about_20():
    torch.manual_seed(4)
    x = torch.randn(512, 512)
    for name in ("e4m3_tensor", "e4m3_row", "e4m3_block_1x128", "mxfp8_e4m3_block32"):
        assert 30 < sqnr(x, fake_quantize(x, cast_spec(name))) < 33, name
    assert 15 < sqnr(x, fake_quantize(x, cast_spec("nvfp4_block16"))) < 22


def test_the_meter_pools_steps_and_equals_a_direct_computation():
    torch.manual_seed(5)
    meter, label = meter_for(TECurrentScalingRecipe())
    weight, bias = torch.randn(32, 64), torch.randn(32)
    steps = [torch.randn(2, 8, 64), torch.randn(2, 8, 64) * 3]
    for step, x in enumerate(steps):
        meter.observe("layer", step, x, weight, bias)
    spec = cast_spec("e4m3_tensor")
    qw = fake_quantize(weight, spec)
    xs = [x.reshape(-1, 64) for x in steps]
    qxs = [fake_quantize(x, spec) for x in xs]  # current scaling: each call scales by its own amax
    ref = [torch.nn.functional.linear(x, weight, bias) for x in xs]
    out = [torch.nn.functional.linear(q, qw, bias) for q in qxs]
    expected = {
        "weight": sqnr(weight, qw),
        "input": db(sum(float(x.square().sum()) for x in xs), sum(float((x - q).square().sum())
                                                                 for x, q in zip(xs, qxs, strict=True))),
        "output": db(sum(float(r.square().sum()) for r in ref), sum(float((r - o).square().sum())
                                                                   for r, o in zip(ref, out, strict=True))),
    }
    result = meter.result("layer", label)
    assert result == pytest.approx({key: round(value, 2) for key, value in expected.items()}, abs=0.011)


def test_the_meter_casts_large_weights_in_slices_with_the_same_result():
    # a weight too large for the cache is cast in slices of whole 128-row blocks, its per-tensor and NVFP4
    # global scales taken from the whole weight: the numbers are the same as from one cast
    torch.manual_seed(7)
    names = ["te-current", "te-float8-block", "te-nvfp4", "ao-rowwise", "te-mxfp8"]
    whole, _ = meter_for(TECurrentScalingRecipe(), names)
    sliced, _ = meter_for(TECurrentScalingRecipe(), names)
    sliced.cache_bytes, sliced.slice_elements = 0, 128 * 64
    weight = torch.randn(384, 64)
    weight[300, 3] = 50.0  # the amax, in the last slice
    for step in range(2):
        x = torch.randn(16, 64)
        for meter in (whole, sliced):
            meter.observe("layer", step, x, weight)
    assert len(sliced._slices(weight)) == 3 and not sliced._cache
    for label in names:
        assert sliced.result("layer", label) == pytest.approx(whole.result("layer", label), abs=0.011), label


def test_delayed_scaling_casts_with_the_history_and_saturates_when_the_amax_jumps():
    # Step 0 uses its own amax (as a seeded state would); step 1's amax is 10x larger, but its scale comes from
    # step 0, so its large values saturate at 448 / scale: far more noise than current scaling's.
    torch.manual_seed(6)
    meter, _ = meter_for(TEDelayedScalingRecipe(), ["te-delayed", "te-current"])
    weight = torch.randn(16, 32)
    x = torch.randn(64, 32)
    meter.observe("layer", 0, x, weight)
    first = meter.result("layer", "te-delayed")
    assert first == meter.result("layer", "te-current")
    meter.observe("layer", 1, x * 10, weight)
    delayed, current = meter.result("layer", "te-delayed"), meter.result("layer", "te-current")
    assert delayed["input"] < current["input"] - 10 and delayed["output"] < current["output"] - 10
    assert delayed["weight"] == current["weight"]


def test_each_recipe_names_its_casts():
    casts = {name: recipe_casts(parse_compare_recipe(name, "x")) for name in (
        "te-delayed", "te-current", "te-mxfp8", "te-float8-block", "te-nvfp4", "ao-tensorwise", "ao-rowwise",
        "ao-mxfp8-op")}
    assert (casts["te-delayed"].weight.name, casts["te-delayed"].delayed is not None) == ("e4m3_tensor", True)
    assert (casts["te-float8-block"].weight.name, casts["te-float8-block"].input.name) == (
        "e4m3_block_128x128", "e4m3_block_1x128")
    assert casts["te-float8-block"].input.scale is ScaleRule.POW2  # TE's default power-of-two block scales
    assert casts["ao-rowwise"].input.scale is ScaleRule.POW2 and casts["ao-rowwise"].input.library == "torchao"
    assert casts["ao-tensorwise"].input.scale is ScaleRule.FP32
    assert casts["te-mxfp8"].input.scale is ScaleRule.E8M0_RCEIL and casts["ao-mxfp8-op"].input.library == "torchao"
    assert (casts["te-nvfp4"].weight.name, casts["te-nvfp4"].input.name) == ("nvfp4_block16x16", "nvfp4_block16")
    assert recipe_casts(TorchAORecipe(recipe_name="rowwise")).label == "ao-rowwise"
    with pytest.raises(RecipeError) as error:
        parse_compare_recipe("te-fp7", "compare_recipes[0]")
    assert error.value.field == "compare_recipes[0]"


def test_request_bounds_of_the_new_fields():
    ConversionRequest(model="m", min_sqnr_db=300, compare_recipes=("te-mxfp8", {"backend": "ao"}))
    for bad in (-1, 300.5, float("nan"), "30", True):
        with pytest.raises(RequestError) as error:
            ConversionRequest(model="m", min_sqnr_db=bad)
        assert error.value.field == "min_sqnr_db"
    with pytest.raises(RequestError) as error:
        ConversionRequest(model="m", compare_recipes=("te-current", {"backend": "te", "scaling": "current"}))
    assert error.value.field == "compare_recipes[1]"
    with pytest.raises(RecipeError) as error:
        ConversionRequest(model="m", compare_recipes=({"backend": "te", "margin": 99},))
    assert error.value.field == "compare_recipes[0].margin"


# --- low_sqnr in a conversion --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_sqnr(models_root, sources):
    """The tiny Llama's per-layer output SQNR under TE delayed scaling, from a calibrated analysis."""
    from converters.pipeline.sync_analysis import calibrated_analysis

    report = calibrated_analysis(_request(models_root, None), sources)
    return {layer["path"]: layer["sqnr_db"]["output"] for layer in report["layers"] if "sqnr_db" in layer}


def _request(models_root, threshold, **fields) -> ConversionRequest:
    return ConversionRequest(model=str(models_root / "llama"), calibration=CalibrationSettings(
        steps=2, batch_size=2, seq_len=32), min_sqnr_db=threshold, **fields)


def test_layers_below_min_sqnr_db_stay_in_high_precision(models_root, sources, llama_sqnr, tmp_path):
    from converters.pipeline.driver import run_conversion

    ordered = sorted(llama_sqnr.values())
    threshold = (ordered[2] + ordered[3]) / 2  # the three worst layers fall below it
    low = sorted(path for path, value in llama_sqnr.items() if value < threshold)
    assert len(low) == 3
    result = run_conversion(_request(models_root, threshold, serving_formats=("compressed-tensors-fp8",)),
                            tmp_path / "out", sources)
    report = json.loads(result.report_path.read_text())
    layers = {layer["path"]: layer for layer in report["analysis"]["layers"]}
    assert sorted(report["analysis"]["sensitivity"]["excluded"]) == low
    for path in low:
        assert layers[path]["eligible"] is False and layers[path]["reasons"] == ["low_sqnr"]
        assert layers[path]["sqnr_db"]["output"] == llama_sqnr[path]  # the same calibration as the analysis
        assert path not in result.converted
    assert len(result.converted) == len(llama_sqnr) - 3
    assert report["analysis"]["totals"]["eligible_layers"] == len(llama_sqnr) - 3
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert not set(low) & set(config["fp8"]["converted_modules"])
    for name in ("fp8_state.safetensors", "fp8_calibration.safetensors"):
        with safe_open(tmp_path / "out" / name, "pt") as handle:
            assert not any(key.startswith(tuple(f"{path}." for path in low)) for key in handle.keys()), name
    ignored = json.loads((tmp_path / "out" / "serving" / "compressed-tensors-fp8" / "config.json").read_text())[
        "quantization_config"]["ignore"]
    assert set(low) <= set(ignored)
    assert any("low_sqnr" in warning for warning in report["warnings"])


def test_a_threshold_above_every_layer_fails_the_conversion(models_root, sources, llama_sqnr, tmp_path):
    from converters.pipeline.driver import run_conversion

    with pytest.raises(RequestError) as error:
        run_conversion(_request(models_root, max(llama_sqnr.values()) + 1), tmp_path / "out", sources)
    assert error.value.field == "min_sqnr_db" and not (tmp_path / "out").exists()


def test_expert_gemms_are_measured_on_routed_tokens_and_excluded_as_a_group(tmp_path):
    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.sync_analysis import calibrated_analysis
    from tests.models import save_tiny_moe

    save_tiny_moe("mixtral", tmp_path / "mixtral")
    sources = ModelSourceOptions(allowed_roots=(tmp_path,), offline=True)
    request = ConversionRequest(model=str(tmp_path / "mixtral"), calibration=CalibrationSettings(
        steps=1, batch_size=2, seq_len=32))
    report = calibrated_analysis(request, sources)
    units = [layer for layer in report["layers"] if "expert" in layer and layer["eligible"]]
    assert units and all(math.isfinite(layer["sqnr_db"]["weight"]) for layer in units)
    routed = [layer for layer in units if layer["sqnr_db"]["output"] is not None]
    assert routed and all(20 < layer["sqnr_db"]["output"] < 40 for layer in routed)
    tokens = {block["module"]: block["tokens_per_expert"] for block in report["moe"]}
    for layer in units:  # no SQNR of input and output exactly where the router sent no token
        got_tokens = tokens[layer["expert"]["module"]][layer["expert"]["index"]] > 0
        assert (layer["sqnr_db"]["output"] is not None) == got_tokens
    worst = min(routed, key=lambda layer: layer["sqnr_db"]["output"])
    group = worst["group"]
    threshold = worst["sqnr_db"]["output"] + 0.005
    excluded = calibrated_analysis(ConversionRequest(model=request.model, calibration=request.calibration,
                                                     min_sqnr_db=threshold), sources)
    members = {layer["path"] for layer in excluded["layers"] if layer.get("group") == group}
    assert members <= set(excluded["sensitivity"]["excluded"])
    assert all(layer["reasons"] == ["low_sqnr"] for layer in excluded["layers"] if layer["path"] in members)
