"""Delayed-scaling state in and out of ``te.Linear`` modules, as the plain tensors of
:mod:`converters.backends.te.layout`.

TE's quantizers and global amax buffers hold *views* of ``fp8_meta["scaling_fwd"|"scaling_bwd"].scale`` and
``.amax_history``, so state is written with in-place ``copy_`` (as TE's own ``set_extra_state`` does).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from converters.backends.te.layout import TE_STATE_NAMES
from converters.backends.te.runtime import build_te_recipe, te_autocast, te_module
from converters.errors import ConversionError
from converters.recipes import TEDelayedScalingRecipe

__all__ = ["check_state_tensors", "apply_scaling_state", "read_scaling_state", "has_delayed_state", "meta_tensor",
           "write_state", "te_extra_state_tensor"]


# Slots per te.Linear (one GEMM): forward input, weight, output; backward grad_output, grad_input.
_N_FWD, _N_BWD = 3, 2
_META_KEYS = {"scale_fwd": ("scaling_fwd", "scale"), "amax_history_fwd": ("scaling_fwd", "amax_history"),
              "scale_bwd": ("scaling_bwd", "scale"), "amax_history_bwd": ("scaling_bwd", "amax_history")}


def check_state_tensors(path: str, tensors: Mapping[str, torch.Tensor], history_len: int) -> None:
    """Check one layer's state: exactly the four te_layout names, shapes ``[3]``, ``[L,3]``, ``[2]``, ``[L,2]``
    with ``L == history_len``, finite values, positive scales and non-negative amax.

    Pure tensor check (no TE). Raises ConversionError naming the layer and the tensor.
    """
    if set(tensors) != set(TE_STATE_NAMES):
        raise ConversionError(f"{path}: scaling state has {sorted(tensors)}, expected {list(TE_STATE_NAMES)}")
    shapes = {"scale_fwd": (_N_FWD,), "amax_history_fwd": (history_len, _N_FWD),
              "scale_bwd": (_N_BWD,), "amax_history_bwd": (history_len, _N_BWD)}
    for name, shape in shapes.items():
        tensor = tensors[name]
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise ConversionError(f"{path}.{name}: shape {got}, expected {shape} (amax_history_len={history_len})")
        if not tensor.is_floating_point() or not bool(torch.isfinite(tensor).all()):
            raise ConversionError(f"{path}.{name}: must hold finite floating-point values")
        if bool((tensor <= 0).any()) if name.startswith("scale") else bool((tensor < 0).any()):
            raise ConversionError(f"{path}.{name}: scales must be > 0 and amax values >= 0")


def apply_scaling_state(model: nn.Module, states: Mapping[str, Mapping[str, torch.Tensor]],
                        recipe: TEDelayedScalingRecipe) -> None:
    """Load our delayed-scaling tensors (te_layout names) into the te.Linear modules at the given paths.

    Each module's FP8 metadata is first initialised as TE does at the first forward (see the module
    docstring), then ``fp8_meta["scaling_fwd"|"scaling_bwd"].scale|amax_history`` are overwritten in place.

    Raises BackendUnavailableError without CUDA/TE; ConversionError for a non-delayed recipe, a path that
    is not a te.Linear, or state that fails :func:`check_state_tensors` against ``recipe.amax_history_len``.
    """
    te = te_module()
    if not isinstance(recipe, TEDelayedScalingRecipe):
        raise ConversionError(f"only delayed scaling carries state; got a {type(recipe).__name__}")
    modules = {path: _te_linear_at(te, model, path) for path in states}
    for path, tensors in states.items():
        check_state_tensors(path, tensors, recipe.amax_history_len)
    with te_autocast(te, enabled=False, calibrating=True, recipe=build_te_recipe(recipe)):
        for module in modules.values():
            module.init_fp8_metadata(num_gemms=1)
    for path, module in modules.items():
        write_state(path, module, states[path])


def read_scaling_state(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The delayed-scaling state of every te.Linear that holds one, as CPU float32 copies (te_layout names).

    te.Linear modules without delayed-scaling state (never initialised, or current scaling) are left out.
    Raises BackendUnavailableError without CUDA/TE.
    """
    te = te_module()
    states = {}
    for path, module in model.named_modules():
        if isinstance(module, te.Linear) and has_delayed_state(module):
            states[path] = {name: meta_tensor(module, name).detach().to("cpu", torch.float32, copy=True)
                            for name in TE_STATE_NAMES}
    return states


def _te_linear_at(te: Any, model: nn.Module, path: str) -> nn.Module:
    try:
        module = model.get_submodule(path)
    except AttributeError as exc:
        raise ConversionError(f"no module at path {path!r}") from exc
    if not isinstance(module, te.Linear):
        raise ConversionError(f"{path!r} is a {type(module).__name__}, not a te.Linear; run convert_to_te first")
    return module


def has_delayed_state(module: nn.Module) -> bool:
    fwd, bwd = module.fp8_meta.get("scaling_fwd"), module.fp8_meta.get("scaling_bwd")
    return all(isinstance(getattr(s, "amax_history", None), torch.Tensor) for s in (fwd, bwd))


def meta_tensor(module: nn.Module, name: str) -> torch.Tensor:
    meta_key, attr = _META_KEYS[name]
    return getattr(module.fp8_meta[meta_key], attr)


def write_state(path: str, module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """In-place copy: TE's quantizers and global amax buffers hold views of these very tensors."""
    if not has_delayed_state(module):
        raise ConversionError(f"{path}: TE did not create delayed-scaling state for this module")
    with torch.no_grad():
        for name in TE_STATE_NAMES:
            dst = meta_tensor(module, name)
            if dst.shape != tensors[name].shape:
                raise ConversionError(f"{path}.{name}: TE holds shape {tuple(dst.shape)}, "
                                      f"the state has {tuple(tensors[name].shape)}")
            dst.copy_(tensors[name].to(dtype=dst.dtype))


def te_extra_state_tensor(module: nn.Module) -> torch.Tensor:
    """TE's own ``_extra_state`` of a te.Linear (``module.get_extra_state()``): a uint8 CPU tensor holding a
    pickle, for the opt-in ``te_extra_state: true`` artifact mode. Loading it needs
    ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` on TE >= 2.18; our default artifact carries plain tensors.

    TE writes the state only while ``fp8_meta["fp8_checkpoint"]`` is set, and clears that flag after any
    forward outside an FP8 autocast; a module holding delayed-scaling state gets the flag set again here.
    Raises BackendUnavailableError without CUDA/TE; ConversionError for a non-te.Linear module, or when
    TE returns an empty state for a module that holds delayed-scaling state.
    """
    te = te_module()
    if not isinstance(module, te.Linear):
        raise ConversionError(f"expected a te.Linear, got {type(module).__name__}")
    stateful = has_delayed_state(module)
    if stateful:
        module.fp8_meta["fp8_checkpoint"] = True
    state = module.get_extra_state()
    if stateful and state.numel() == 0:
        raise ConversionError("TransformerEngine returned an empty _extra_state for a module with scaling state")
    return state
