"""FP8 KV-cache scales chosen by the error they cause in the attention output (a clipping search).

Per-tensor ``amax / 448`` spends the E4M3 range on the one largest key or value of the calibration run; the
rest land on few mantissa steps. For each attention layer this module tries smaller scales, ``amax * r / 448``
for the ratios :data:`CLIP_RATIOS`, and keeps the one whose FP8 keys (after RoPE, as the engines store them)
or values change the layer's attention output least. Keys and values are searched separately (the other kept in
high precision), then the chosen pair is measured together.

The ratio is fitted on the even calibration steps and kept only if, on the odd steps, which it was not fitted on,
it leaves at most :data:`MIN_GAIN` of the error ``amax / 448`` leaves; else the layer keeps ``amax / 448``. Why so
strict: on SmolLM2-135M ratios that lowered the calibration tokens' attention error by 5-40% per layer raised the
held-out perplexity with vLLM's CUDA rounding (+0.63% against +0.13% at amax/448) while lowering it with its CPU
build's truncation (+0.38% against +0.68%): docs/benchmarks/kv-scales-2026-12-03.md. A clipping is taken where
amax/448 leaves most values underflowing or a rare outlier costs everything else its precision, not for the
few per cent that rounding alignment gives.

Why clipping is safe in the engine: vLLM saturates to +-448 when it writes the FP8 cache (the CUDA kernels
convert with ``__NV_SATFINITE``; vLLM 0.32's CPU ``cpu_attn_reshape_and_cache``, run on a 1000.0 key with scale
1 and 0.01, wrote 448 and no NaN), so a clipped key is stored as the largest FP8 value, which is what
:func:`fake_quantize_e4m3` does here.

The search runs the layer's own attention kernel (the function transformers dispatched to, with the call's
mask and scaling) on the recorded queries, keys and values, so it measures exactly the attention the model
computes. Its cost per layer is ``(2 * len(CLIP_RATIOS) + 2)`` attention calls per calibration step.

Across the ranks of a data-parallel job each rank measures its own steps, and the per-step error sums
(:class:`KvStepErrors`) are gathered and added in the job's step order: the even/odd split and every sum are then
those of one process that ran all the steps, so the scales do not depend on the rank count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from converters.calibration.scaling import E4M3_MAX

__all__ = ["CLIP_RATIOS", "MIN_GAIN", "Gather", "KvSearch", "KvStep", "KvStepErrors", "fake_quantize_e4m3",
           "search_kv_scales"]

#: candidate fractions of the amax, 1.0 first: a ratio replaces 1.0 only when its error is strictly lower
CLIP_RATIOS: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35, 0.3)

#: a clipping is kept only where it leaves at most this fraction of amax/448's error on the steps it was not fitted on
MIN_GAIN = 0.5

#: ``attend(query, key, value) -> attention output``: the layer's kernel with one step's mask and arguments
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class KvStep:
    """One calibration step's attention inputs, as the model handed them to its kernel."""

    query: torch.Tensor
    key: torch.Tensor  #: ``[batch, kv_heads, seq, head_dim]`` after RoPE
    value: torch.Tensor
    attend: Attend


@dataclass(frozen=True, kw_only=True)
class KvSearch:
    """The chosen clipping of one attention layer's KV cache and what FP8 costs there.

    Errors are the attention output's relative mean squared error, ``sum((out_fp8 - out)^2) / sum(out^2)`` over
    the searched steps.
    """

    key_ratio: float  #: the key scale is ``key amax * key_ratio / 448``
    value_ratio: float
    error_at_amax: float  #: keys and values both at ``amax / 448``
    error_chosen: float  #: keys and values both at the chosen scales
    key_errors: tuple[float, ...]  #: per ratio of :data:`CLIP_RATIOS`, keys in FP8 and values not
    value_errors: tuple[float, ...]
    steps: int  #: calibration steps searched (all unless the layer's buffer limit was reached)

    def to_dict(self) -> dict[str, object]:
        return {"k_clip_ratio": self.key_ratio, "v_clip_ratio": self.value_ratio,
                "attention_error_at_amax": self.error_at_amax, "attention_error": self.error_chosen,
                "searched_steps": self.steps}


def fake_quantize_e4m3(tensor: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """``tensor`` stored as E4M3 with ``scale`` and read back: divide, saturate to +-448, round, multiply.

    Computed in float32 and returned in ``tensor``'s dtype, as an engine dequantizes the cache into the
    attention's dtype.
    """
    scaled = (tensor.float() / scale).clamp(-E4M3_MAX, E4M3_MAX)
    return (scaled.to(torch.float8_e4m3fn).float() * scale).to(tensor.dtype)


def clipped_scale(amax: float, ratio: float) -> torch.Tensor:
    """``amax * ratio / 448`` in float32 (a zero amax gives 1: nothing to represent, any scale is exact)."""
    clipped = torch.tensor(amax, dtype=torch.float32) * torch.tensor(ratio, dtype=torch.float32)
    return torch.where(clipped == 0, torch.ones(()), clipped / E4M3_MAX)


def _step_errors(steps: Sequence[KvStep], references: Sequence[torch.Tensor], key_scale: torch.Tensor | None,
                 value_scale: torch.Tensor | None) -> list[float]:
    """Each step's squared error of the attention output with keys and/or values stored in E4M3."""
    errors = []
    for step, reference in zip(steps, references, strict=True):
        key = step.key if key_scale is None else fake_quantize_e4m3(step.key, key_scale)
        value = step.value if value_scale is None else fake_quantize_e4m3(step.value, value_scale)
        errors.append(float((step.attend(step.query, key, value).float() - reference).square().sum()))
    return errors


def _ratio(errors: Sequence[Sequence[float]], energy: Sequence[float]) -> int:
    """Index of the ratio to keep: the lowest error on the even steps, if on the odd steps it leaves at most
    :data:`MIN_GAIN` of ratio 1.0's error.

    With one step there is nothing to check against: the lowest error on it. Ties keep the larger ratio.
    """
    fit, check = (slice(0, None, 2), slice(1, None, 2)) if len(energy) > 1 else (slice(None), slice(None))
    fitted = [sum(per_step[fit]) for per_step in errors]
    best = min(range(len(fitted)), key=lambda index: (fitted[index], index))
    if fitted[best] >= fitted[0] or sum(errors[best][check]) > MIN_GAIN * sum(errors[0][check]):
        return 0
    return best


def _total(errors: Sequence[float], energy: Sequence[float]) -> float:
    return sum(errors) / sum(energy) if sum(energy) > 0 else 0.0


@dataclass(frozen=True)
class KvStepErrors:
    """What one calibration step contributes to a layer's search: plain numbers, so that the ranks of a
    data-parallel job can exchange them (:func:`search_kv_scales`'s ``gather``)."""

    step: int  #: the calibration step (the job's numbering: the search sums in this order)
    size: int  #: bytes its queries, keys and values held (the search's buffer limit counts them)
    energy: float  #: ``sum(out^2)`` of the high-precision attention output
    key: tuple[float, ...]  #: per ratio: squared error with the keys in FP8 (values not)
    value: tuple[float, ...]
    pair: float  #: squared error with both at the scales asked for (``amax / 448`` in the first round)


#: every rank's items, concatenated (a one-process search: the items themselves)
Gather = Callable[[list[KvStepErrors]], list[KvStepErrors]]


def _alone(items: list[KvStepErrors]) -> list[KvStepErrors]:
    return items


def _within(items: list[KvStepErrors], budget: int | None) -> list[KvStepErrors]:
    """``items`` in step order, up to the first one past ``budget`` bytes (the first always): the steps one
    process would have kept, whatever the ranks each kept (each keeps a superset of its part of them)."""
    items, kept, held = sorted(items, key=lambda item: item.step), [], 0
    for item in items:
        if kept and budget is not None and held + item.size > budget:
            break
        kept.append(item)
        held += item.size
    return kept


def search_kv_scales(steps: Sequence[KvStep], key_amax: float, value_amax: float,
                     ratios: Sequence[float] = CLIP_RATIOS, *, numbers: Sequence[int] | None = None,
                     budget: int | None = None, gather: Gather = _alone) -> KvSearch:
    """Choose the key and value clipping ratios of one attention layer by its attention-output error.

    ``steps`` are the layer's recorded attention calls; ``key_amax``/``value_amax`` the per-tensor amax over all
    of them (over every rank's). A rank of a data-parallel job passes its steps' ``numbers`` in the job, the
    buffer ``budget`` in bytes and a ``gather`` that all-gathers the :class:`KvStepErrors` of every rank: the
    errors are then summed over the job's steps in step order, so the choice and every figure are the ones a
    single process computes from all the steps, whatever the rank count. Every rank must call it (a rank may have
    no steps). Raises ValueError for no steps on any rank, ``numbers`` not matching ``steps``, or a ratio outside
    (0, 1] (a caller's mistake, not a user's).
    """
    if not ratios or ratios[0] != 1.0 or any(not 0 < ratio <= 1 for ratio in ratios):
        raise ValueError(f"clipping ratios must start at 1.0 and lie in (0, 1], got {tuple(ratios)}")
    numbers = list(range(len(steps))) if numbers is None else list(numbers)
    if len(numbers) != len(steps):
        raise ValueError(f"{len(numbers)} step numbers for {len(steps)} recorded attention calls")
    with torch.no_grad():
        references = [step.attend(step.query, step.key, step.value).float() for step in steps]
        at_amax = (clipped_scale(key_amax, 1.0), clipped_scale(value_amax, 1.0))
        mine = _measure(steps, references, numbers, ratios, key_amax, value_amax, at_amax)
        every = _within(gather(mine), budget)
        if not every:
            raise ValueError("search_kv_scales needs at least one recorded attention call")
        energy = [item.energy for item in every]
        key_errors = [[item.key[index] for item in every] for index in range(len(ratios))]
        value_errors = [[item.value[index] for item in every] for index in range(len(ratios))]
        key_ratio, value_ratio = ratios[_ratio(key_errors, energy)], ratios[_ratio(value_errors, energy)]
        error_at_amax = _total([item.pair for item in every], energy)
        chosen = error_at_amax
        if not key_ratio == value_ratio == 1.0:  # every rank takes this branch: the same numbers chose the ratios
            searched = {item.step for item in every}
            pair = (clipped_scale(key_amax, key_ratio), clipped_scale(value_amax, value_ratio))
            kept = [(step, reference, number) for step, reference, number in zip(steps, references, numbers,
                                                                                  strict=True) if number in searched]
            errors = _step_errors([s for s, _, _ in kept], [r for _, r, _ in kept], *pair)
            items = gather([KvStepErrors(number, 0, 0.0, (), (), error)
                            for (_, _, number), error in zip(kept, errors, strict=True)])
            chosen = _total([item.pair for item in sorted(items, key=lambda item: item.step)], energy)
        if chosen > error_at_amax:  # each choice helped alone but not together: keep amax/448 for both
            key_ratio, value_ratio, chosen = 1.0, 1.0, error_at_amax
    return KvSearch(key_ratio=key_ratio, value_ratio=value_ratio, error_at_amax=error_at_amax, error_chosen=chosen,
                    key_errors=tuple(_total(per_step, energy) for per_step in key_errors),
                    value_errors=tuple(_total(per_step, energy) for per_step in value_errors), steps=len(every))


def _measure(steps: Sequence[KvStep], references: Sequence[torch.Tensor], numbers: Sequence[int],
             ratios: Sequence[float], key_amax: float, value_amax: float,
             at_amax: tuple[torch.Tensor, torch.Tensor]) -> list[KvStepErrors]:
    """The first round's errors of each of this process's steps."""
    key_errors = [_step_errors(steps, references, clipped_scale(key_amax, ratio), None) for ratio in ratios]
    value_errors = [_step_errors(steps, references, None, clipped_scale(value_amax, ratio)) for ratio in ratios]
    pair = _step_errors(steps, references, *at_amax)
    return [KvStepErrors(step=number, size=sum(t.numel() * t.element_size() for t in (s.query, s.key, s.value)),
                         energy=float(reference.square().sum()),
                         key=tuple(errors[index] for errors in key_errors),
                         value=tuple(errors[index] for errors in value_errors), pair=pair[index])
            for index, (s, reference, number) in enumerate(zip(steps, references, numbers, strict=True))]
