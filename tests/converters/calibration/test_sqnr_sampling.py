"""The SQNR meter's sampled figures (token rows and output channels) stay near the exact ones, outliers included."""

from __future__ import annotations

import pytest
import torch

from converters.calibration.sensitivity import recipe_casts
from converters.calibration.sqnr_meter import SqnrMeter
from converters.recipes.presets import parse_compare_recipe


def _layer(seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(4096, 256, generator=generator) * 0.02
    weight[640:768] *= 8  # one block of output channels with outlier weights
    x = torch.randn(4, 512, 256, generator=generator)
    x[:, 0] *= 30  # each sequence's first token carries an outlier activation, as real models' do
    return weight.to(torch.bfloat16), x.to(torch.bfloat16)


@pytest.mark.parametrize("recipe", ["te-current", "te-delayed", "te-mxfp8", "te-nvfp4", "ao-rowwise"])
def test_sampled_sqnr_is_within_half_a_db_of_the_exact_figure(recipe):
    weight, x = _layer()
    casts = [recipe_casts(parse_compare_recipe(recipe, "test"), recipe)]
    exact, sampled = SqnrMeter(casts, max_rows=None, max_channels=None), SqnrMeter(casts)
    for step in range(4):
        output = torch.nn.functional.linear(x[step], weight)
        for meter in (exact, sampled):
            meter.observe("layer", step, x[step], weight, output=output)
    channels = sampled._channels_of("layer", weight)
    assert channels.rows is not None and channels.rows.numel() == 512  # it did sample: 4 of 32 blocks
    assert bool(torch.isin(torch.arange(640, 768), channels.rows).all())  # the outlier block is measured exactly
    got, want = sampled.result("layer", recipe), exact.result("layer", recipe)
    for what in ("weight", "input", "output"):
        assert abs(got[what] - want[what]) < 0.5, (what, got, want)


def test_small_layers_are_measured_whole():
    weight, x = _layer()
    meter = SqnrMeter([recipe_casts(parse_compare_recipe("te-current", "test"), "te-current")])
    small = weight[:2048]  # up to 4 x max_channels rows: measured whole
    meter.observe("small", 0, x[0, :16], small, output=torch.nn.functional.linear(x[0, :16], small))
    assert meter._channels_of("small", small).rows is None
    with pytest.raises(ValueError, match="max_channels"):
        SqnrMeter([], max_channels=100)


@pytest.mark.parametrize("recipe", ["te-delayed", "te-current", "te-nvfp4", "ao-rowwise"])
def test_measuring_a_layer_in_one_batch_gives_the_figures_of_measuring_each_call(recipe):
    """The rows of all calls cast and multiplied at once (each row with its own call's scale) give the sums of
    measuring every call as it comes (flush_rows=1: a flush per call)."""
    weight, x = _layer()
    casts = [recipe_casts(parse_compare_recipe(recipe, "test"), recipe)]
    batched, per_call = SqnrMeter(casts), SqnrMeter(casts, flush_rows=1)
    for step in range(4):
        scaled = x[step] * (1 + step)  # each call's own per-tensor (and delayed) scale differs
        output = torch.nn.functional.linear(scaled, weight)
        for meter in (batched, per_call):
            meter.observe("layer", step, scaled, weight, output=output)
    assert "layer" in batched._pending and not per_call._pending  # the batched one had not measured yet
    got, want = batched.result("layer", recipe), per_call.result("layer", recipe)
    for what in ("weight", "input", "output"):
        assert got[what] == pytest.approx(want[what], abs=0.011), (what, got, want)


def test_an_output_channel_outlier_is_measured_exactly_even_with_ordinary_weights():
    """A residual stream's massive activation lives in one output channel whose weight row looks ordinary: the
    channels are chosen by the output's energy, so its block is measured, not sampled."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(4096, 256, generator=generator) * 0.02
    x = torch.randn(256, 256, generator=generator)
    output = torch.nn.functional.linear(x, weight)
    output[:, 3000] *= 500  # as if a bias-free layer's output carried a massive activation there
    meter = SqnrMeter([recipe_casts(parse_compare_recipe("te-current", "test"), "te-current")])
    meter.observe("layer", 0, x, weight, output=output)
    channels = meter._channels_of("layer", weight)
    assert channels.rows is not None and 3000 in channels.rows.tolist()
    measured = channels.rows == 3000
    assert float(channels.weights[measured]) == 1.0  # in a top block: counted once, not standing for others


def test_linears_called_on_the_same_input_share_its_sampled_rows_until_it_changes():
    """q, k and v (or gate and up) see one tensor: its rows are sampled and gathered once; a tensor changed in
    place since, or the next step, is sampled again."""
    weight, x = _layer()
    meter = SqnrMeter([recipe_casts(parse_compare_recipe("te-current", "test"), "te-current")])
    shared = x[0]
    first = meter.input_rows(shared, weight.shape[1], step=0)
    assert meter.input_rows(shared, weight.shape[1], step=0) is first
    assert meter.input_rows(shared, weight.shape[1], step=1) is not first
    changed = x[1].clone()
    before = meter.input_rows(changed, weight.shape[1], step=1)
    changed.mul_(2)
    after = meter.input_rows(changed, weight.shape[1], step=1)
    assert after is not before and float(after.row_amax.max()) == 2 * float(before.row_amax.max())


def test_gathered_rows_are_measured_once_they_pass_the_memory_bound():
    """A whole-model pass calls every layer before the first is done: the rows waiting stay under pending_bytes."""
    weight, x = _layer()
    casts = [recipe_casts(parse_compare_recipe("te-current", "test"), "te-current")]
    bounded, unbounded = SqnrMeter(casts, pending_bytes=20_000), SqnrMeter(casts)
    for index in range(4):
        output = torch.nn.functional.linear(x[index], weight)
        for meter in (bounded, unbounded):
            meter.observe(f"layer{index}", 0, x[index], weight, output=output)
    assert len(unbounded._pending) == 4 and len(bounded._pending) < 4
    for index in range(4):
        assert bounded.result(f"layer{index}", "te-current") == unbounded.result(f"layer{index}", "te-current")


@pytest.mark.parametrize("recipe", ["te-current", "te-nvfp4"])
def test_the_emulated_gemm_in_bf16_stays_within_a_twentieth_of_a_db_of_fp32(recipe):
    """A bf16 layer's emulated FP8 GEMM runs in bf16 (its cast operands rounded to bf16): the output SQNR is that
    of the same casts multiplied in fp32, computed here independently, to within 0.05 dB."""
    from converters.casts.emulation import db, fake_quantize

    weight, x = _layer()
    casts = recipe_casts(parse_compare_recipe(recipe, "test"), recipe)
    meter = SqnrMeter([casts], max_rows=None, max_channels=None)
    output = torch.nn.functional.linear(x[0], weight)
    meter.observe("layer", 0, x[0], weight, output=output)
    xf, wf = x[0].float(), weight.float()
    qx = fake_quantize(xf, casts.input, tensor_amax=xf.abs().amax())
    qw = fake_quantize(wf, casts.weight, tensor_amax=wf.abs().amax())
    reference = output.float()
    want = db(float(reference.square().sum()), float((reference - qx @ qw.T).square().sum()))
    assert meter.result("layer", recipe)["output"] == pytest.approx(want, abs=0.05)


def test_a_longer_calibration_spreads_the_rows_per_layer_over_its_steps():
    """With rows_per_layer, more steps measure fewer rows a call (the meter's cost stays fixed while the forward's
    grows), never fewer than eight per sequence of a call, never more than max_rows; the default 16 steps keep
    max_rows a call."""
    weight, x = _layer()
    casts = [recipe_casts(parse_compare_recipe("te-current", "test"), "te-current")]

    def rows_a_call(steps: int, sequences: int) -> int:
        meter = SqnrMeter(casts, rows_per_layer=512)
        meter.expect_steps(steps)
        return meter.input_rows(x[:sequences], weight.shape[1], step=0).rows.shape[0]

    assert rows_a_call(16, 2) == 32  # 512 / 16: max_rows, as without rows_per_layer
    assert rows_a_call(4, 2) == 32  # never more than max_rows
    assert rows_a_call(64, 1) == 8  # 512 / 64
    assert rows_a_call(256, 1) == 8 and rows_a_call(256, 2) == 16  # eight per sequence at least
    assert rows_a_call(256, 8) == 32  # and still never more than max_rows
    without = SqnrMeter(casts)
    without.expect_steps(64)
    assert without.input_rows(x[:1], weight.shape[1], step=0).rows.shape[0] == 32
    with pytest.raises(ValueError, match="rows_per_layer"):
        SqnrMeter(casts, rows_per_layer=0)


def test_the_thinner_spread_still_measures_every_sequence_s_first_token_exactly():
    """Four sequences a call, each with an outlier first token: a budget of eight per sequence puts all four in the
    exactly measured quarter, so the sampled figures stay within half a dB of the exact ones over 64 steps."""
    weight, x = _layer()
    casts = [recipe_casts(parse_compare_recipe("te-current", "test"), "te-current")]
    exact, sampled = SqnrMeter(casts, max_rows=None, max_channels=None), SqnrMeter(casts, rows_per_layer=512)
    for meter in (exact, sampled):
        meter.expect_steps(64)
    generator = torch.Generator().manual_seed(3)
    for step in range(64):
        ordinary = 1 + torch.randperm(511, generator=generator)[:63]
        batch = x[:, torch.cat([torch.zeros(1, dtype=torch.long), ordinary])]  # each starts with its outlier token
        output = torch.nn.functional.linear(batch, weight)
        picked = sampled.input_rows(batch, weight.shape[1], step)
        # 32 rows, less the few that the spread's whole-number stride leaves out at some offsets
        assert picked.picked is not None and 28 <= picked.picked.numel() <= 32
        assert set(range(0, 256, 64)) <= set(picked.picked.tolist())  # each sequence's first row
        for meter in (exact, sampled):
            meter.observe("layer", step, batch, weight, output=output)
    got, want = sampled.result("layer", "te-current"), exact.result("layer", "te-current")
    for what in ("input", "output"):
        assert abs(got[what] - want[what]) < 0.5, (what, got, want)


@pytest.mark.parametrize("recipe", ["te-delayed", "te-current", "te-nvfp4", "te-float8-block"])
def test_a_meter_without_cached_casts_measures_the_same(recipe):
    """A job's meter keeps no cast weights (cache_bytes=0): the weight is cast once at the layer's flush, for the
    weight's SQNR as well as the output's; the figures are those of a meter that measured the weight at once and
    kept its casts for the flush."""
    weight, x = _layer()
    casts = [recipe_casts(parse_compare_recipe(recipe, "test"), recipe)]
    kept, uncached = SqnrMeter(casts), SqnrMeter(casts, cache_bytes=0)
    for step in range(3):
        output = torch.nn.functional.linear(x[step], weight)
        for meter in (kept, uncached):
            meter.observe("layer", step, x[step], weight, output=output)
        if step == 0:  # the weight's SQNR at once, its casts kept for the flush (as the experts' hooks do)
            kept.observe_weight("layer", weight)
            assert "layer" in kept._cache and "layer" in kept._weighed
    kept.drop_cast_weights()
    assert "layer" in uncached._pending and "layer" not in uncached._weighed  # nothing cast before its flush
    uncached.drop_cast_weights()
    assert not uncached._cache and "layer" in uncached._weighed
    assert uncached.result("layer", recipe) == kept.result("layer", recipe)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_row_amax_from_the_bits_equals_the_largest_magnitude(dtype):
    from converters.calibration.sqnr_arithmetic import amax_per_row as _row_amax

    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(64, 300, generator=generator) * 40).to(dtype)
    x[1, 7], x[2, 9], x[3] = -float("inf"), float("nan"), -0.0  # a negative infinity, a NaN, a row of -0
    x[4, 5] = -torch.finfo(dtype).max  # the largest magnitude is a negative value
    got = _row_amax(x)
    want = x.abs().amax(dim=1).float()
    assert got.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan()) and bool(got.isnan()[2])
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert float(got[1]) == float("inf") and float(got[3]) == 0.0 and not got[3].signbit()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (a GPU worker's calibration meters there)")
@pytest.mark.parametrize("recipe", ["te-current", "te-nvfp4"])
def test_a_gpu_worker_meters_its_layers_on_the_gpu_with_the_cpu_s_figures(recipe):
    """A calibration on a GPU observes CUDA tensors: the sampled rows, their weights and the measured channels must
    live there too (a GPU job failed in the meter's flush before they did)."""
    weight, x = _layer()
    casts = [recipe_casts(parse_compare_recipe(recipe, "test"), recipe)]
    on_cpu, on_gpu = SqnrMeter(casts), SqnrMeter(casts)
    for step in range(4):
        for meter, device in ((on_cpu, "cpu"), (on_gpu, "cuda")):
            w, xs = weight.to(device), x[step].to(device)
            meter.observe("layer", step, xs, w, output=torch.nn.functional.linear(xs, w))
    got, want = on_gpu.result("layer", recipe), on_cpu.result("layer", recipe)
    for what in ("weight", "input", "output"):
        assert abs(got[what] - want[what]) < 0.05, (what, got, want)
