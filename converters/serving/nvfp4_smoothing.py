"""NVFP4 W4A4: per-input-channel smoothing scales chosen by the output error they leave (AWQ's ratio search).

A W4A4 layer casts both its input and its weight to FP4 in blocks of 16 along the input channels. A few input
channels carry most of the activation's magnitude; dividing channel ``c`` of the input by ``s_c`` and multiplying
column ``c`` of the weight by ``s_c`` computes the same product in high precision and moves the cast's error
between the two sides. For one fused group (q/k/v or gate/up share their input; any other Linear is a group of one)
and a sample ``x`` of its calibration inputs, the candidates are AWQ's: ``s = x_mean^r / w_mean^(1-r)`` for ``r``
in ``[0, 1)`` (``x_mean``: the mean ``|x|`` of each input channel; ``w_mean``: the mean over the group's rows of
``|w| / its row's max``), divided by ``sqrt(max(s) * min(s))``; each is scored by the W4A4 output error the engine
would see, ``sum over members ||x W^T - Q(x / s) Q(W s)^T||^2`` (as
:func:`~converters.serving.nvfp4_search.group_output_error` scores a group: the input cast per 16-block under the
amax of ``x / s``, the weight by round to nearest under the group's global scale). No scaling (``s = 1``) is
always a candidate and is kept unless a ratio is strictly better.

The scales fold into what feeds the group: an RMSNorm's weight (divided by ``s``) or the previous Linear's rows
(``up_proj``'s, for ``down_proj``), so the model computes the same function in high precision (to the dtype's
rounding) and an engine reads ordinary tensors: no extra input multiplier. ``benchmarks/bench_nvfp4_smooth.py``
measures it on the real SmolLM2 (docs/benchmarks has the figures).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from converters.casts.emulation import cast_spec, fake_quantize
from converters.serving.nvfp4 import GROUP, quantize_nvfp4
from converters.serving.nvfp4_search import dequantize_nvfp4

__all__ = ["RATIO_STEPS", "SearchShare", "SmoothingChoice", "candidate_scales", "fold_scales", "search_smoothing"]

#: ratios tried: r = k / RATIO_STEPS for k in 0 .. RATIO_STEPS - 1 (AWQ's default grid)
RATIO_STEPS = 20
_FLOOR = 1e-4  # a channel that never fires (or a zero column) gets a finite scale
_INPUT_CAST = cast_spec("nvfp4_block16")


@dataclass(frozen=True, kw_only=True)
class SmoothingChoice:
    """What :func:`search_smoothing` chose for one fused group, and the output errors behind the choice."""

    scales: torch.Tensor | None  #: fp32 ``[in]``; None: no ratio beat leaving the group as it is
    ratio: float | None  #: the chosen ``r`` (None with no scales)
    error: float  #: the group's summed squared W4A4 output error with the choice
    plain_error: float  #: the same without scaling

    @property
    def relative_error(self) -> float:
        """The chosen scales' output error over the unscaled one (1.0: kept as it is)."""
        return self.error / self.plain_error if self.plain_error > 0 else 1.0


def candidate_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float) -> torch.Tensor:
    """AWQ's scales for ``ratio``: ``x_mean^r / w_mean^(1-r)``, normalised so that ``max * min = 1`` (fp32)."""
    scales = (x_mean.float().clamp(min=_FLOOR).pow(ratio) / w_mean.float().clamp(min=_FLOOR).pow(1 - ratio))
    return scales / (scales.max() * scales.min()).sqrt()


def _w4a4_error(x: torch.Tensor, exact: list[torch.Tensor], weights: list[torch.Tensor],
                scales: torch.Tensor | None) -> float:
    """``sum ||exact - Q(x / s) Q(W s)^T||^2``: the input cast under the amax of ``x / s`` as the engine's kernels
    cast it, the scaled weights rounded to the model's dtype, then to nearest under the group's global scale."""
    scaled_x = x if scales is None else x / scales
    scaled = weights if scales is None else [(w.float() * scales).to(w.dtype) for w in weights]
    amax = max(float(w.float().abs().max()) for w in scaled)
    cast_x = fake_quantize(scaled_x, _INPUT_CAST, tensor_amax=scaled_x.abs().max())
    return float(sum((reference - cast_x @ dequantize_nvfp4(*quantize_nvfp4(w, amax)).T).square().sum()
                     for reference, w in zip(exact, scaled, strict=True)))


@dataclass(frozen=True)
class SearchShare:
    """The ranks of a data-parallel job sharing one search: of the candidates (no scaling, then each ratio) this
    rank scores every ``world_size``-th from its ``rank``-th, and ``combine`` returns every rank's scores."""

    rank: int
    world_size: int
    combine: Callable[[dict[int, float]], dict[int, float]]


_PLAIN = -1  #: the candidate "no scaling" among the ratios' indices


def search_smoothing(weights: list[torch.Tensor], x: torch.Tensor, *, steps: int = RATIO_STEPS,
                     share: SearchShare | None = None) -> SmoothingChoice:
    """The smoothing scales of least W4A4 output error for one fused group (see the module docstring).

    Args:
        weights: the group's weights (``[out_m, in]`` each, in the model's dtype), sharing one input.
        x: calibration inputs of the group (``[tokens, in]``), as the high-precision model computes them.
        steps: ratios tried, ``k / steps`` for ``k`` in ``0 .. steps - 1``.
        share: the ranks scoring the candidates between them (each the same ``weights`` and ``x``); the choice is
            the one process's: the least error, the earliest candidate on a tie.

    Raises:
        ValueError: no weights, a weight whose ``in`` is not a multiple of 16 or differs from ``x``'s, or
            ``steps`` below 1.
    """
    if not weights:
        raise ValueError("search_smoothing needs at least one weight")
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    columns = x.shape[-1]
    for weight in weights:
        if weight.dim() != 2 or weight.shape[1] != columns or columns % GROUP:
            raise ValueError(f"each weight must be [out, in] with in = x's {columns}, a multiple of {GROUP}; "
                             f"got {tuple(weight.shape)}")
    x = x.reshape(-1, columns).float()
    x_mean = x.abs().mean(0)
    rows = torch.cat([w.float().abs() for w in weights])
    w_mean = (rows / rows.amax(dim=1, keepdim=True).clamp(min=1e-12)).mean(0)
    exact = [x @ w.float().T for w in weights]
    candidates = [_PLAIN, *range(steps)]
    if share is not None:
        candidates = candidates[share.rank::share.world_size]
    errors = {k: _w4a4_error(x, exact, weights, None if k == _PLAIN else candidate_scales(x_mean, w_mean, k / steps))
              for k in candidates}
    if share is not None:
        errors = share.combine(errors)
    best = _PLAIN
    for k in range(steps):  # strictly better only: no scaling, then the lowest ratio, wins a tie
        if errors[k] < errors[best]:
            best = k
    if best == _PLAIN:
        return SmoothingChoice(scales=None, ratio=None, error=errors[_PLAIN], plain_error=errors[_PLAIN])
    return SmoothingChoice(scales=candidate_scales(x_mean, w_mean, best / steps), ratio=best / steps,
                           error=errors[best], plain_error=errors[_PLAIN])


def fold_scales(feeder: torch.Tensor, weights: list[torch.Tensor], scales: torch.Tensor
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``scales`` folded in: the feeder (an RMSNorm's ``[in]`` weight, or the previous Linear's ``[in, k]``) divided,
    each of the group's weights multiplied column-wise; computed in fp32, returned in each tensor's dtype.

    Raises:
        ValueError: a feeder whose first dimension is not the group's ``in``.
    """
    if feeder.shape[0] != scales.shape[0]:
        raise ValueError(f"the feeder's {feeder.shape[0]} outputs do not feed the group's {scales.shape[0]} inputs "
                         "(e.g. v_proj -> o_proj with grouped-query attention): this mapping cannot be smoothed")
    divisor = scales if feeder.dim() == 1 else scales[:, None]
    return ((feeder.float() / divisor).to(feeder.dtype),
            [(weight.float() * scales).to(weight.dtype) for weight in weights])
