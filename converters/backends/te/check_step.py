"""One real FP8 step of a whole model with te.Linear layers, leaving its calibrated state as it was (CUDA + TE)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from converters.backends.te.layer_check import rows_padded
from converters.backends.te.layout import TE_STATE_NAMES
from converters.backends.te.runtime import build_te_recipe, require_fp8_execution, te_autocast, te_module
from converters.backends.te.state import check_state_tensors, meta_tensor, read_scaling_state, write_state
from converters.errors import ConversionError
from converters.recipes import TECurrentScalingRecipe, TEDelayedScalingRecipe

__all__ = ["fp8_check_step"]



def fp8_check_step(model: nn.Module, batch: Mapping[str, torch.Tensor],
                   recipe: TEDelayedScalingRecipe | TECurrentScalingRecipe) -> dict[str, Any]:
    """One real FP8 forward and backward step under TE's autocast, leaving the model's state as it was.

    What TE does to delayed-scaling state during the step: the forward writes each tensor's amax into
    row 0 of ``amax_history`` using the *current* scales (our calibrated ones); leaving the autocast runs
    the forward update (amax from the history, then ``roll(-1)``, row 0 zeroed, new scale); the backward
    does the same for the backward state. So the calibrated state is snapshotted first and copied back
    afterwards (and checked), and the gradients the step produced are dropped (``.grad`` restored).

    ``batch`` holds model inputs (e.g. ``input_ids`` ``[B, S]``); TE needs ``B*S % 8 == 0``. The loss is
    ``outputs.loss`` when the batch has labels, else the mean square of the logits.

    Returns ``{"recipe", "loss", "output_finite", "backward", "layers": {path: {"amax_fwd_step",
    "scale_fwd_before", "scale_fwd_after", "scale_bwd_before", "scale_bwd_after"}}, "state_restored"}``
    (lists of floats; ``layers`` is empty for current scaling). Raises BackendUnavailableError without
    CUDA/TE or without FP8 support on this GPU; ConversionError for an unusable batch, missing or
    mismatched state, a non-finite output or loss, or state that could not be restored.
    """
    te = te_module()
    require_fp8_execution(te)
    before = _check_step_preconditions(te, model, batch, recipe)
    te_recipe = build_te_recipe(recipe)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    grads = {p: p.grad for p in model.parameters()}

    try:
        with torch.enable_grad(), rows_padded(te, model):
            with te_autocast(te, enabled=True, recipe=te_recipe):
                outputs = model(**inputs)
                step_amax = {p: meta_tensor(model.get_submodule(p), "amax_history_fwd")[0].tolist() for p in before}
            loss = _check_step_loss(outputs)
            if loss.requires_grad:
                loss.backward()
        after = read_scaling_state(model)
    finally:
        for param, grad in grads.items():
            param.grad = grad
        for path, tensors in before.items():
            write_state(path, model.get_submodule(path), tensors)
    restored = read_scaling_state(model)
    if any(not torch.equal(restored[p][n], before[p][n]) for p in before for n in TE_STATE_NAMES):
        raise ConversionError("the calibrated scaling state could not be restored after the FP8 check step")
    layers = {p: {"amax_fwd_step": step_amax[p],
                  **{f"{n}_{w}": s[n].tolist() for w, s in (("before", before[p]), ("after", after[p]))
                     for n in ("scale_fwd", "scale_bwd")}} for p in before}
    return {"recipe": recipe.to_dict(), "loss": float(loss), "output_finite": True,
            "backward": bool(loss.requires_grad), "layers": layers, "state_restored": True}


def _check_step_preconditions(te: Any, model: nn.Module, batch: Mapping[str, torch.Tensor],
                              recipe: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Validate the batch and the model's state against the recipe; return the state snapshot."""
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor) and ids.numel() % 8 != 0:
        raise ConversionError(f"FP8 check batch has {ids.numel()} tokens; TE needs batch*seq divisible by 8")
    before = read_scaling_state(model)
    linears = [p for p, m in model.named_modules() if isinstance(m, te.Linear)]
    if not linears:
        raise ConversionError("the model has no te.Linear modules; run convert_to_te first")
    if isinstance(recipe, TECurrentScalingRecipe):
        if before:
            raise ConversionError("the model holds delayed-scaling state; check it with its delayed recipe")
        return before
    missing = sorted(set(linears) - set(before))
    if missing:
        raise ConversionError(f"te.Linear modules without scaling state: {missing[:5]}; apply_scaling_state first")
    for path, tensors in before.items():
        check_state_tensors(path, tensors, recipe.amax_history_len)
    return before


def _check_step_loss(outputs: Any) -> torch.Tensor:
    logits = getattr(outputs, "logits", None)
    if logits is None:
        logits = next(_tensors(outputs), None)
    if logits is None or not bool(torch.isfinite(logits).all()):
        raise ConversionError("the FP8 check step produced a non-finite (or no) output")
    loss = getattr(outputs, "loss", None)
    loss = logits.float().square().mean() if loss is None else loss
    if not bool(torch.isfinite(loss)):
        raise ConversionError(f"the FP8 check step produced a non-finite loss ({float(loss)})")
    return loss


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):  # transformers' ModelOutput is an OrderedDict
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
