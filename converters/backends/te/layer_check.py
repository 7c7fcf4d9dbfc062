"""The TransformerEngine FP8 check, one layer at a time (CUDA + TE only).

In layer-sequential mode each calibrated layer, still on the GPU with its cached inputs, has its eligible
Linears swapped for ``te.Linear`` with the state calibration just produced, runs one batch under
``te.autocast`` and is compared with the high-precision output it gave a moment before (cosine in the
report). Every converted layer is checked and no second copy of the model is ever on the GPU.

TE executes an FP8 GEMM only when the product of the input's leading dims is a multiple of 8
(``assert_dim_for_fp8_exec``); pooled ``[batch, hidden]`` inputs often are not, so each te.Linear's input
is padded with zero rows for the check and its output cut back. Zero rows leave the amax unchanged.
"""

from __future__ import annotations

import importlib
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from converters.backends.te.runtime import build_te_recipe, require_fp8_execution, te_autocast, te_module
from converters.backends.te.state import apply_scaling_state
from converters.backends.te.swap import convert_to_te
from converters.calibration.amax import te_scaling_state
from converters.errors import BackendUnavailableError, ConversionError
from converters.recipes import TEDelayedScalingRecipe

if TYPE_CHECKING:
    from collections.abc import Iterator

    from converters.calibration.sequential import LayerPass

__all__ = ["LayerChecks", "check_layer", "rows_padded", "reset_te_global_state"]


_ROWS = 8


class LayerChecks:
    """``after_layer`` callback: check each layer in FP8 and collect the results for the report."""

    def __init__(self, recipe: Any) -> None:
        self.recipe = recipe
        self.layers: dict[str, dict[str, Any]] = {}
        self.skipped: str | None = None

    def __call__(self, layer_pass: LayerPass) -> None:
        if self.skipped is not None or not layer_pass.linear_paths:
            return
        try:
            self.layers[layer_pass.path] = check_layer(layer_pass, self.recipe)
        except BackendUnavailableError as exc:  # TE imports, but this GPU cannot execute FP8 (before sm89)
            self.skipped = exc.message
        finally:
            reset_te_global_state()

    def summary(self) -> dict[str, Any]:
        if self.skipped is not None:
            return {"ran": False, "reason": self.skipped}
        cosines = [entry["cosine"] for entry in self.layers.values()]
        return {"ran": True, "mode": "per layer", "recipe": self.recipe.to_dict(), "layers": self.layers,
                "min_cosine": min(cosines) if cosines else None}


def check_layer(layer_pass: LayerPass, recipe: Any) -> dict[str, Any]:
    """Swap the layer's eligible Linears for te.Linear, seed their state, run step 0 in FP8, compare outputs.

    Raises BackendUnavailableError where this GPU cannot run FP8, ConversionError (naming the layer) when
    TE fails on the layer or its output is not finite.
    """
    te = te_module()
    require_fp8_execution(te)
    prefix = f"{layer_pass.path}."
    relative = [path.removeprefix(prefix) for path in layer_pass.linear_paths]
    device = layer_pass.outputs[0].device
    convert_to_te(layer_pass.layer, relative, device=device)
    if isinstance(recipe, TEDelayedScalingRecipe):
        states = {path.removeprefix(prefix): te_scaling_state(layer_pass.amax[path], recipe)
                  for path in layer_pass.linear_paths}
        apply_scaling_state(layer_pass.layer, states, recipe)
    try:
        with torch.no_grad(), rows_padded(te, layer_pass.layer), \
                te_autocast(te, enabled=True, recipe=build_te_recipe(recipe)):
            output = layer_pass.call(layer_pass.layer, 0)
    except Exception as exc:  # TE raises AssertionError/RuntimeError from its kernels; the job must say where
        raise ConversionError(f"the TransformerEngine FP8 check of {layer_pass.path} failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    reference = layer_pass.outputs[0]
    if not bool(torch.isfinite(output).all()):
        raise ConversionError(f"the TransformerEngine FP8 check of {layer_pass.path} produced non-finite outputs")
    cosine = torch.nn.functional.cosine_similarity(output.float().flatten(), reference.float().flatten(), dim=0)
    return {"cosine": float(cosine), "linears": len(relative)}


@contextmanager
def rows_padded(te: Any, layer: nn.Module) -> Iterator[None]:
    """Pad every te.Linear input to a multiple of 8 rows for the check, and cut the padding off the output."""
    padded: dict[int, torch.Size] = {}  # module -> the leading dims of the input it was really given

    def pad(module: nn.Module, args: tuple) -> tuple | None:
        x = args[0]
        rows = x.numel() // x.shape[-1]
        if rows % _ROWS == 0:
            return None
        padded[id(module)] = x.shape[:-1]
        flat = x.reshape(rows, x.shape[-1])
        return (torch.cat([flat, flat.new_zeros((_ROWS - rows % _ROWS, x.shape[-1]))]), *args[1:])

    def cut(module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        leading = padded.pop(id(module), None)
        if leading is None:
            return None
        return output[: leading.numel()].reshape(*leading, output.shape[-1])

    handles = []
    try:
        for module in layer.modules():
            if isinstance(module, te.Linear):
                handles.append(module.register_forward_pre_hook(pad))
                handles.append(module.register_forward_hook(cut))
        yield
    finally:
        for handle in handles:
            handle.remove()


def reset_te_global_state() -> None:
    """Drop TE's global FP8 buffers (amax reduction lists hold references to every module's state), so a
    process that checks or loads models one after another frees them. No-op where TE is absent."""
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        try:
            manager = importlib.import_module(name).FP8GlobalStateManager
        except (ImportError, AttributeError):
            continue
        manager.reset()
        return
