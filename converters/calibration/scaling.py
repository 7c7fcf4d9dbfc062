"""TransformerEngine delayed scaling, reproduced as pure fp32 tensor math on CPU.

Verified against TransformerEngine 2.20 source:

* ``transformer_engine/common/recipe/delayed_scaling.cu`` (``kernel_bulk``, reached through
  ``tex.fused_amax_and_scale_update_after_reduction``): the update TE runs by default after each step;
* ``transformer_engine/pytorch/quantization.py`` (``reduce_and_update_fp8_tensors``,
  ``_default_get_amax_and_update_history``, ``_default_sf_compute``, ``get_fp8_max``): when it runs,
  and the unfused reference path (used only with ``NVTE_UNFUSED_FP8_UPDATE=1`` or callable algorithms);
* ``transformer_engine/common/recipe/__init__.py`` (``Format``): the FP8 maxima.

Nothing here imports TransformerEngine; the functions take plain tensors and return plain tensors.
"""

from __future__ import annotations

from enum import Enum

import torch

from converters.casts.emulation import E4M3_MAX, E5M2_MAX
from converters.errors import RecipeError

__all__ = [
    "E4M3_MAX",
    "E5M2_MAX",
    "FP8_MAX",
    "FLT_MAX",
    "fp8_max_for",
    "delayed_scaling_state",
]


FP8_MAX = {"e4m3": E4M3_MAX, "e5m2": E5M2_MAX}
#: The scale TE writes when ``fp8_max / amax`` overflows fp32.
FLT_MAX = float(torch.finfo(torch.float32).max)

_DIRECTIONS = ("forward", "backward")
_ALGOS = ("max", "most_recent")


def _name(value: object) -> str:
    raw = value.value if isinstance(value, Enum) else value
    if not isinstance(raw, str):
        raise RecipeError(f"Expected a string, got {value!r}.", field="fp8_format")
    return raw.strip().lower()


def fp8_max_for(fp8_format: object, direction: str) -> float:
    """FP8 maximum TE scales to, as in ``get_fp8_max``.

    Forward tensors are E4M3 (448) under both formats; backward tensors are E5M2 (57344) under HYBRID
    and E4M3 (448) under E4M3. ``fp8_format`` is a ``Fp8Format`` or a case-insensitive string.
    Raises RecipeError for an unknown format or direction.
    """
    fmt = _name(fp8_format)
    if fmt not in ("hybrid", "e4m3"):
        raise RecipeError(f"fp8_format must be HYBRID or E4M3, got {fp8_format!r}.", field="fp8_format")
    if direction not in _DIRECTIONS:
        raise RecipeError(f"direction must be forward or backward, got {direction!r}.", field="direction")
    if direction == "backward" and fmt == "hybrid":
        return FP8_MAX["e5m2"]
    return FP8_MAX["e4m3"]


def delayed_scaling_state(
    amax_per_step: torch.Tensor,
    *,
    history_len: int,
    algo: str,
    margin: int,
    fp8_max: torch.Tensor | float,
    initial_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and amax history that TE delayed scaling holds after the given FP8 steps.

    Args:
        amax_per_step: ``[steps, n]`` amax of each of the ``n`` FP8 tensors of one module at each step
            (0 where the tensor was not cast that step).
        history_len: ``amax_history_len`` (rows of the history).
        algo: ``"max"`` or ``"most_recent"`` (a ``AmaxComputeAlgo`` works too).
        margin: ``DelayedScaling.margin`` (int >= 0).
        fp8_max: FP8 maximum per tensor (``[n]``) or one float for all (see :func:`fp8_max_for`).
        initial_scale: scale before the first step; TE allocates ones.

    Returns:
        ``(scale [n], amax_history [history_len, n])``, fp32, as TE holds them after the last update.

    TE's state and the order of one step, per tensor column, as ``kernel_bulk`` does it:

    1. During the step the quantizer writes the tensor's amax into row 0 (row 0 is the current slot;
       TE's Float8Quantizer holds a view of ``amax_history[0][i]``; repeated casts keep the maximum).
    2. After the step (forward: at ``autocast`` exit; backward: at the end of the first module's
       backward) ``last = h[0]`` is read and, only if ``last != 0``:
       ``amax_max`` = max over all rows *before* the roll (NaN ignored, as ``fmaxf``), then the history
       is rolled, ``h = roll(h, -1, 0); h[0] = 0``: the current amax moves to the last row and the
       oldest value falls off. If ``last == 0`` (the tensor was not cast) there is no roll and
       ``amax_max`` stays 0, so under ``"max"`` the scale is kept rather than recomputed from the
       window. (The unfused Python path in quantization.py rolls regardless; the fused kernel is TE's
       default and is what is reproduced here.)
    3. ``amax = last`` for ``"most_recent"``, ``amax_max`` for ``"max"``.
    4. ``scale = (fp8_max * 2**-margin) / amax`` in fp32 (the kernel's ``scaled_max / amax``, one
       correctly rounded division: delayed_scaling.cu is not built with --use_fast_math); the old
       scale is kept where ``amax`` is not finite or ``<= 0``; an infinite result becomes FLT_MAX.
       TE's unfused Python path computes ``(fp8_max / amax) / 2**margin`` in eager mode as a
       reciprocal and a multiply, which can differ from this by one ulp.

    So after ``k`` steps the last ``min(k, history_len - 1)`` non-zero amaxes sit at the end of the
    history (most recent last) and row 0 is 0, ready for the next step. Raises RecipeError for a bad
    ``algo``/``history_len``/``margin`` and ValueError for mis-shaped tensors.
    """
    algo_name = algo.value if isinstance(algo, Enum) else algo
    if algo_name not in _ALGOS:
        raise RecipeError(
            f"amax_compute_algo must be max or most_recent, got {algo!r}.", field="amax_compute_algo"
        )
    if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
        raise RecipeError(
            f"amax_history_len must be an integer >= 1, got {history_len!r}.", field="amax_history_len"
        )
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise RecipeError(f"margin must be an integer >= 0, got {margin!r}.", field="margin")
    if amax_per_step.dim() != 2:
        raise ValueError(f"amax_per_step must be [steps, n], got shape {tuple(amax_per_step.shape)}.")

    amax_per_step = amax_per_step.detach().to(device="cpu", dtype=torch.float32)
    n = amax_per_step.shape[1]
    fp8_max_t = torch.as_tensor(fp8_max, dtype=torch.float32).expand(n).clone()
    # The kernel multiplies by pow(2.f, -margin) before dividing; doing the same keeps the FLT_MAX
    # edge (tiny amax) identical when margin > 0.
    scaled_max = fp8_max_t * torch.pow(torch.tensor(2.0, dtype=torch.float32), -margin)
    if initial_scale is None:
        scale = torch.ones(n, dtype=torch.float32)
    else:
        scale = initial_scale.detach().to(device="cpu", dtype=torch.float32).reshape(n).clone()
    history = torch.zeros(history_len, n, dtype=torch.float32)

    for step_amax in amax_per_step:
        # Row 0 is always 0 here (zeroed by the last roll, or never written), so this equals the
        # quantizer's running max within the step.
        history[0] = step_amax
        last = history[0].clone()
        seen = last != 0  # NaN != 0 is true, as in the kernel
        window_max = torch.where(torch.isnan(history), torch.zeros_like(history), history)
        window_max = window_max.amax(dim=0).clamp_min(0.0)
        rolled = torch.roll(history, -1, 0)
        rolled[0] = 0.0
        history = torch.where(seen, rolled, history)
        if algo_name == "most_recent":
            amax = last
        else:
            amax = torch.where(seen, window_max, torch.zeros_like(last))
        new_scale = scaled_max / amax
        new_scale = torch.where(torch.isfinite(amax) & (amax > 0), new_scale, scale)
        scale = torch.where(torch.isinf(new_scale), torch.full_like(new_scale, FLT_MAX), new_scale)
    return scale, history
