"""The probe's TransformerEngine half (CUDA + TE): one step under the artifact's recipe, and per ``te.Linear`` what
its FP8 state shows.

TE's GEMMs are C++ calls, so each module is read instead (TE 2.x ``module/base.py``): ``init_fp8_metadata`` sets
``module.fp8`` to whether an FP8 autocast was active at its forward and ``fp8_meta["recipe"]`` to the recipe it
ran; delayed scaling also writes the step's amax into ``fp8_meta["scaling_fwd"].amax_history`` (rolled into the
last row when the autocast exits), so an FP8 forward leaves a changed history.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from converters.backends.gemm_trace import GemmKind, LinearCheck
from converters.backends.te.layer_check import reset_te_global_state
from converters.backends.te.runtime import require_fp8_execution, te_autocast, te_module
from converters.backends.te.state import has_delayed_state, meta_tensor

__all__ = ["te_step_checks"]


def te_step_checks(model: nn.Module, ids: torch.Tensor, expected: set[str], step: Callable[[nn.Module, Any], float]
                   ) -> tuple[float, list[Any], list[str]]:
    """Run ``step`` under ``te.autocast(recipe=model.fp8_recipe)``; return the loss, a LinearCheck per Linear and
    te.Linear, and the recipe classes the modules ran. Raises BackendUnavailableError where FP8 cannot execute."""
    te = te_module()
    require_fp8_execution(te)
    modules = {path: module for path, module in model.named_modules()
               if isinstance(module, (te.Linear, nn.Linear))}
    before = {path: meta_tensor(module, "amax_history_fwd").clone() for path, module in modules.items()
              if isinstance(module, te.Linear) and has_delayed_state(module)}
    try:
        with te_autocast(te, enabled=True, recipe=model.fp8_recipe):
            loss = step(model, ids)
    finally:
        reset_te_global_state()
    layers, active = [], set()
    for path, module in modules.items():
        if not isinstance(module, te.Linear):
            layers.append(LinearCheck(path=path, expected_fp8=path in expected, ran=GemmKind.HIGH_PRECISION,
                                      detail="torch.nn.Linear"))
            continue
        recipe = module.fp8_meta.get("recipe")
        ran_fp8 = bool(getattr(module, "fp8", False))
        detail = f"te.Linear fp8={ran_fp8} recipe={type(recipe).__name__}"
        if path in before:
            changed = not torch.equal(before[path], meta_tensor(module, "amax_history_fwd"))
            ran_fp8 = ran_fp8 and changed
            detail += f", amax history {'updated' if changed else 'unchanged'}"
        active.add(f"TransformerEngine {type(recipe).__name__}: {recipe!r}")
        layers.append(LinearCheck(path=path, expected_fp8=path in expected,
                                  ran=GemmKind.FP8 if ran_fp8 else GemmKind.HIGH_PRECISION, detail=detail))
    return loss, layers, sorted(active)
