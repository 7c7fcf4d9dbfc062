"""TE delayed scaling reproduced in converters.calibration.scaling, checked against hand-computed states.

Every expected history below was worked out by hand from TE's fused update (delayed_scaling.cu):
write the step's amax to row 0; if it is non-zero take the max over all rows, roll by -1 and zero
row 0; scale = 448 / 2**margin / amax (or keep the old scale).
"""

from __future__ import annotations

import math

import pytest
import torch

from converters.calibration.scaling import FLT_MAX, FP8_MAX, delayed_scaling_state, fp8_max_for
from converters.errors import RecipeError


def _col(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1)


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


# (amax per step, history_len, algo, margin, expected scale, expected history column)
HAND_CASES = [
    # history longer than 1, equal to steps: [2,4,1] -> h=[0,4,1] (2 fell off), max=4.
    ([2, 4, 1], 3, "max", 0, 112.0, [0, 4, 1]),
    ([2, 4, 1], 3, "most_recent", 0, 448.0, [0, 4, 1]),
    # history longer than the step count: nothing falls off.
    ([2, 4, 1], 5, "max", 0, 112.0, [0, 0, 2, 4, 1]),
    ([2, 4, 1], 5, "most_recent", 0, 448.0, [0, 0, 2, 4, 1]),
    # history shorter than the step count: only the last amax survives in a length-2 history,
    # and the 8 from step 2 no longer counts at step 4.
    ([2, 8, 1, 3], 2, "max", 0, _f32(448 / 3), [0, 3]),
    # length 1: the window is just the current amax.
    ([2, 8, 1, 4], 1, "max", 0, 112.0, [0]),
    # margin divides by 2**margin.
    ([2], 4, "max", 1, 112.0, [0, 0, 0, 2]),
    ([7], 2, "most_recent", 3, 8.0, [0, 7]),
    # zero amax (layer not run): no roll, scale kept — even under max with a non-zero window.
    ([2, 0, 0], 3, "max", 0, 224.0, [0, 0, 2]),
    ([0, 4], 3, "max", 0, 112.0, [0, 0, 4]),
    ([0, 0], 3, "most_recent", 0, 1.0, [0, 0, 0]),
    # inf amax: history rolls, but a non-finite amax keeps the old scale.
    ([2, math.inf], 3, "max", 0, 224.0, [0, 2, math.inf]),
]


@pytest.mark.parametrize(("amax", "length", "algo", "margin", "scale", "history"), HAND_CASES)
def test_delayed_scaling_matches_hand_computed(amax, length, algo, margin, scale, history):
    got_scale, got_history = delayed_scaling_state(
        _col(amax), history_len=length, algo=algo, margin=margin, fp8_max=448.0
    )
    assert got_scale.dtype == torch.float32 and got_history.dtype == torch.float32
    assert got_scale.tolist() == [scale]
    assert got_history[:, 0].tolist() == history


def test_columns_are_independent_and_use_their_own_fp8_max():
    amax = torch.tensor([[2.0, 0.0, 1.0], [4.0, 0.0, 8.0]])
    scale, history = delayed_scaling_state(
        amax, history_len=2, algo="max", margin=0, fp8_max=torch.tensor([448.0, 448.0, 57344.0])
    )
    assert scale.tolist() == [112.0, 1.0, 7168.0]
    assert history.tolist() == [[0.0, 0.0, 0.0], [4.0, 0.0, 8.0]]


def test_tiny_amax_gives_flt_max_not_inf():
    tiny = torch.tensor([[1e-45]])  # rounds to the smallest fp32 subnormal; 448 / it overflows
    scale, _ = delayed_scaling_state(tiny, history_len=2, algo="max", margin=0, fp8_max=448.0)
    assert scale.item() == FLT_MAX


def test_initial_scale_is_kept_until_an_amax_is_seen():
    scale, _ = delayed_scaling_state(
        _col([0.0]), history_len=2, algo="max", margin=0, fp8_max=448.0, initial_scale=torch.tensor([5.0])
    )
    assert scale.tolist() == [5.0]


def test_nan_amax_keeps_scale_under_most_recent_and_is_ignored_by_max():
    amax = _col([4.0, math.nan])
    recent, _ = delayed_scaling_state(amax, history_len=3, algo="most_recent", margin=0, fp8_max=448.0)
    window, history = delayed_scaling_state(amax, history_len=3, algo="max", margin=0, fp8_max=448.0)
    assert recent.tolist() == [112.0]
    assert window.tolist() == [112.0]  # fmaxf skips NaN; the 4 is still in the window
    assert history[1, 0].item() == 4.0 and math.isnan(history[2, 0].item())


def test_no_steps_gives_te_initial_state():
    scale, history = delayed_scaling_state(
        torch.zeros(0, 3), history_len=4, algo="max", margin=0, fp8_max=448.0
    )
    assert scale.tolist() == [1.0, 1.0, 1.0]
    assert history.shape == (4, 3) and not history.any()


def _te_unfused_reference(amax_per_step, history_len, algo, margin, fp8_max):
    """TE's Python path (_default_get_amax_and_update_history + _default_sf_compute), which equals the
    fused kernel whenever every amax is positive. One change: the division is done tensor / tensor.
    Eager ``float / tensor`` is computed as ``reciprocal(tensor) * float`` (two roundings), whereas the
    fused CUDA kernel (TE's default path, built without --use_fast_math) divides once, IEEE-correctly."""
    n = amax_per_step.shape[1]
    history = torch.zeros(history_len, n)
    scale = torch.ones(n)
    for row in amax_per_step:
        history[0] = row
        amax = history.max(dim=0).values if algo == "max" else history[0].clone()
        if history_len > 1:
            history = torch.roll(history, -1, 0)
        history[0] = 0.0
        sf = (torch.full_like(amax, fp8_max) / amax) / (2**margin)
        sf = torch.where(amax > 0.0, sf, scale)
        sf = torch.where(torch.isfinite(amax), sf, scale)
        scale = torch.where(torch.isinf(sf), torch.full_like(sf, FLT_MAX), sf)
    return scale, history


@pytest.mark.parametrize(
    ("history_len", "algo", "margin"), [(1, "max", 0), (4, "max", 2), (16, "most_recent", 1)]
)
def test_matches_te_python_reference_for_positive_amax(history_len, algo, margin):
    amax = torch.rand(10, 3, generator=torch.Generator().manual_seed(0)) * 20 + 0.01
    scale, history = delayed_scaling_state(
        amax, history_len=history_len, algo=algo, margin=margin, fp8_max=448.0
    )
    ref_scale, ref_history = _te_unfused_reference(amax, history_len, algo, margin, 448.0)
    assert torch.equal(history, ref_history)
    assert torch.equal(scale, ref_scale)


@pytest.mark.parametrize(
    ("fmt", "direction", "expected"),
    [
        ("HYBRID", "forward", 448.0),
        ("HYBRID", "backward", 57344.0),
        ("hybrid", "backward", 57344.0),
        ("E4M3", "forward", 448.0),
        ("E4M3", "backward", 448.0),
    ],
)
def test_fp8_max_for(fmt, direction, expected):
    assert fp8_max_for(fmt, direction) == expected


def test_fp8_max_for_accepts_the_recipe_enum():
    from converters.recipes import Fp8Format

    assert fp8_max_for(Fp8Format.HYBRID, "backward") == FP8_MAX["e5m2"]


def test_hybrid_backward_scale_uses_e5m2_max():
    amax = _col([4.0])
    hybrid, _ = delayed_scaling_state(
        amax, history_len=2, algo="max", margin=0, fp8_max=fp8_max_for("HYBRID", "backward")
    )
    e4m3, _ = delayed_scaling_state(
        amax, history_len=2, algo="max", margin=0, fp8_max=fp8_max_for("E4M3", "backward")
    )
    assert hybrid.tolist() == [14336.0] and e4m3.tolist() == [112.0]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"fp8_format": "E5M2", "direction": "forward"}, "fp8_format"),
        ({"fp8_format": "HYBRID", "direction": "sideways"}, "direction"),
    ],
)
def test_fp8_max_for_rejects(kwargs, field):
    with pytest.raises(RecipeError) as info:
        fp8_max_for(kwargs["fp8_format"], kwargs["direction"])
    assert info.value.field == field


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"algo": "mean"}, "amax_compute_algo"),
        ({"history_len": 0}, "amax_history_len"),
        ({"margin": -1}, "margin"),
    ],
)
def test_delayed_scaling_rejects_bad_settings(overrides, field):
    kwargs = {"history_len": 2, "algo": "max", "margin": 0, "fp8_max": 448.0} | overrides
    with pytest.raises(RecipeError) as info:
        delayed_scaling_state(_col([1.0]), **kwargs)
    assert info.value.field == field
