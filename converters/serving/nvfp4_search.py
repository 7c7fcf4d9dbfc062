"""NVFP4 scales chosen per fused group by the error they cause in the group's output on calibration activations.

Round to nearest takes every scale from an amax: the weight global scale from the group's largest ``|w|``, the
input global scale from the largest ``|x|`` the calibration saw, each block's E4M3 scale from its own amax. None of
them looks at what the layer computes. Here, for one fused group (q/k/v or gate/up share their input and, as vLLM
requires, their weight and input global scales; any other Linear is a group of one) and a sample ``x`` of its
calibration inputs, the candidates are scored by the W4A4 output error the engine would see,
``sum over members ||x W^T - Q(x) Q(W)^T||^2``, where ``Q(x)`` is the engines' activation cast (E4M3 scales per
16 computed at run time under the stored input global scale) and ``Q(W)`` what the file holds:

1. the weight: each block-scale method of :data:`~converters.serving.nvfp4.SCALE_SEARCHES` (``rtn``, ``mse``,
   ``four_over_six``) under each weight global scale ``2688 / (amax * r)`` for ``r`` in :data:`WEIGHT_RATIOS`
   (ModelOpt's and llm-compressor's MSE observers search the global scale with the block scales: the global scale
   decides where every block's scale falls on the E4M3 grid, and ``r < 1`` clips the largest blocks), with the
   input cast at round to nearest's input scale;
2. then the input global scale ``2688 / (input_amax * r)`` for ``r`` in :data:`INPUT_RATIOS`, with the chosen
   weight: ``r < 1`` saturates the few largest activations (on attention-sink models, a sequence's first token)
   so that every other block's E4M3 scale has more of the grid.

Round to nearest (``rtn``, ``r = 1``, ``r = 1``) is always a candidate and is kept unless a candidate is strictly
better, so the measured error never grows. The choice is expressed as an effective weight amax and input amax, the
two numbers an NVFP4 export's scales come from, so a choice is written by the ordinary writer
(:class:`~converters.serving.nvfp4.CompressedTensorsNVFP4`, ``quantize(..., weight_amax=...)``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from converters.casts.emulation import cast_spec, fake_quantize
from converters.serving.nvfp4 import GROUP, SCALE_SEARCHES, quantize_nvfp4

__all__ = ["INPUT_RATIOS", "WEIGHT_RATIOS", "GroupChoice", "dequantize_nvfp4", "group_output_error", "search_group"]

#: multipliers of the group's weight amax tried for the weight global scale (1: round to nearest's)
WEIGHT_RATIOS = (1.0, 0.97, 0.94, 0.9, 0.85, 1.03, 1.06, 1.1)
#: multipliers of the calibrated input amax tried for the input global scale (1: round to nearest's)
INPUT_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 1.1, 1.2)
_INPUT_CAST = cast_spec("nvfp4_block16")
_E2M1_CODES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True, kw_only=True)
class GroupChoice:
    """What :func:`search_group` chose for one fused group, and the output errors behind the choice."""

    method: str  #: block-scale method (one of SCALE_SEARCHES)
    weight_amax: float  #: the amax the weight global scale is computed from (``2688 / weight_amax``)
    input_amax: float  #: the amax the input global scale is computed from
    error: float  #: the group's summed squared output error with this choice
    rtn_error: float  #: the same with round to nearest's scales

    @property
    def relative_error(self) -> float:
        """The chosen scales' output error over round to nearest's (1.0: RTN kept)."""
        return self.error / self.rtn_error if self.rtn_error > 0 else 1.0


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_global: torch.Tensor) -> torch.Tensor:
    """The weight an engine reads from NVFP4 tensors: ``code * scale / global`` (fp32 ``[out, in]``)."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    values = torch.tensor(_E2M1_CODES)[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    step = scale.float() / scale_global.float()
    return (values.unflatten(-1, (-1, GROUP)) * step.unsqueeze(-1)).flatten(-2)


def _cast_input(x: torch.Tensor, input_amax: float) -> torch.Tensor:
    return fake_quantize(x.float(), _INPUT_CAST, tensor_amax=torch.tensor(input_amax, dtype=torch.float32))


def group_output_error(x: torch.Tensor, weights: list[torch.Tensor], quantized: list[torch.Tensor],
                       input_amax: float | None) -> float:
    """``sum ||x W^T - Q(x) Wq^T||^2`` over a group's members (``input_amax`` None: the input kept as it is)."""
    return _Scorer(x, weights).error(quantized, input_amax)


class _Scorer:
    """One group's output error, with the exact outputs and each input cast computed once."""

    def __init__(self, x: torch.Tensor, weights: list[torch.Tensor]) -> None:
        self.x = x.float()
        self.reference = [self.x @ weight.float().T for weight in weights]
        self.casts: dict[float | None, torch.Tensor] = {None: self.x}

    def error(self, quantized: list[torch.Tensor], input_amax: float | None) -> float:
        if input_amax not in self.casts:
            self.casts[input_amax] = _cast_input(self.x, input_amax)
        cast = self.casts[input_amax]
        return float(sum((exact - cast @ q.T).square().sum() for exact, q in zip(self.reference, quantized,
                                                                                 strict=True)))


def _dequantized(weights: list[torch.Tensor], weight_amax: float, method: str) -> list[torch.Tensor]:
    return [dequantize_nvfp4(*quantize_nvfp4(w, weight_amax, scale_search=method)) for w in weights]


def search_group(weights: list[torch.Tensor], x: torch.Tensor, weight_amax: float, input_amax: float | None, *,
                 methods: tuple[str, ...] = SCALE_SEARCHES, weight_ratios: tuple[float, ...] = WEIGHT_RATIOS,
                 input_ratios: tuple[float, ...] = INPUT_RATIOS,
                 known: dict[tuple[str, float], list[torch.Tensor]] | None = None) -> GroupChoice:
    """The NVFP4 scales of least output error for one fused group (see the module docstring).

    The weight global scale is searched with round-to-nearest block scales (cheap), then each method of
    ``methods`` is tried under the best ratio and under 1.0 (a searched method costs ten RTN quantizations),
    then the input global scale under the chosen weight.

    Args:
        weights: the group's weights (``[out_m, in]`` each, in the model's dtype), sharing one input.
        x: calibration inputs of the group (``[tokens, in]``), as the high-precision model computes them.
        weight_amax: the group's largest ``|w|`` (round to nearest's weight global scale).
        input_amax: the calibrated input amax (round to nearest's input global scale); None for weight-only
            NVFP4 (``nvfp4-a16``): the input stays in high precision and no input scale is searched.
        methods, weight_ratios, input_ratios: the candidates; ``"rtn"`` and the ratio 1.0 are always tried.
        known: dequantized weights (:func:`dequantize_nvfp4`, one per member) the caller already has, by (method,
            weight ratio): not quantized again (a searched method costs ten round-to-nearest quantizations).

    Raises:
        ValueError: no weights, a weight whose ``in`` is not a multiple of 16 or differs from ``x``'s, a method
            :func:`quantize_nvfp4` does not know, or a ratio that is not positive.
    """
    if not weights:
        raise ValueError("search_group needs at least one weight")
    columns = x.shape[-1]
    for weight in weights:
        if weight.dim() != 2 or weight.shape[1] != columns or columns % GROUP:
            raise ValueError(f"each weight must be [out, in] with in = x's {columns}, a multiple of {GROUP}; "
                             f"got {tuple(weight.shape)}")
    if any(ratio <= 0 for ratio in (*weight_ratios, *input_ratios)):
        raise ValueError("ratios must be positive")
    scorer = _Scorer(x.reshape(-1, columns), weights)

    def quantized_at(ratio: float, method: str) -> list[torch.Tensor]:
        if known is not None and (method, ratio) in known:
            return known[method, ratio]
        return _dequantized(weights, weight_amax * ratio, method)

    rtn = quantized_at(1.0, "rtn")
    rtn_error = scorer.error(rtn, input_amax)
    best = (rtn_error, "rtn", 1.0, rtn)
    for ratio in dict.fromkeys(weight_ratios):
        if ratio != 1.0:
            quantized = quantized_at(ratio, "rtn")
            best = min(best, (scorer.error(quantized, input_amax), "rtn", ratio, quantized), key=lambda c: c[0])
    for method in dict.fromkeys(methods):
        for ratio in dict.fromkeys((best[2], 1.0)):
            if method != "rtn":
                quantized = quantized_at(ratio, method)
                best = min(best, (scorer.error(quantized, input_amax), method, ratio, quantized), key=lambda c: c[0])
    error, method, weight_ratio, quantized = best
    chosen_input_amax = input_amax
    if input_amax is not None:
        for ratio in input_ratios:
            candidate = scorer.error(quantized, input_amax * ratio)
            if candidate < error:
                error, chosen_input_amax = candidate, input_amax * ratio
    return GroupChoice(method=method, weight_amax=weight_amax * weight_ratio,
                       input_amax=chosen_input_amax if chosen_input_amax is not None else 0.0, error=error,
                       rtn_error=rtn_error)
