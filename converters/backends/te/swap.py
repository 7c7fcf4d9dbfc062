"""Swap ``nn.Linear`` layers for ``te.Linear`` with the same weights, keeping tied parameters tied (CUDA + TE)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from converters.backends.te.runtime import te_module
from converters.errors import ConversionError

__all__ = ["convert_to_te"]

logger = logging.getLogger(__name__)


def convert_to_te(model: nn.Module, layer_paths: Sequence[str], *, device: str | torch.device = "cuda") -> list[str]:
    """Swap each listed ``nn.Linear`` for a ``te.Linear`` with the same weights; move the model to ``device``.

    ``layer_paths`` are exact module paths (the eligible layers of the analysis report). The new module is
    ``te.Linear(in, out, bias=..., params_dtype=<weight dtype>, device=device)`` with weight and bias
    copied. Tied weights stay tied: a parameter of a swapped Linear that other modules (or another swapped
    Linear) also held is replaced everywhere by the one new TE parameter, so e.g. a tied embedding and
    ``lm_head`` keep sharing one tensor. A module reachable under several paths must be listed under all
    of them (it becomes one shared te.Linear) or none.

    Returns the converted paths. Raises BackendUnavailableError without CUDA/TE (before touching the
    model); ConversionError for a duplicate, missing or non-Linear path, a partly listed shared module, or
    when the te.Linear paths after the swap differ from ``layer_paths``.
    """
    te = te_module()
    targets = _resolve_targets(model, layer_paths)
    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]] = {}  # id(old param) -> (old, new); keeps old alive
    new_modules: dict[int, nn.Module] = {}
    for path in sorted(targets, key=lambda p: p.count("."), reverse=True):  # children first
        old = targets[path]
        if id(old) not in new_modules:
            new_modules[id(old)] = _te_linear_like(te, old, device, replaced)
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path), name, new_modules[id(old)])
    _retie(model, replaced)
    model.to(device)
    converted = sorted(p for p, m in model.named_modules(remove_duplicate=False) if isinstance(m, te.Linear))
    if converted != sorted(layer_paths):
        extra, missing = sorted(set(converted) - set(layer_paths)), sorted(set(layer_paths) - set(converted))
        raise ConversionError(
            f"expected {len(layer_paths)} te.Linear modules after the swap, found {len(converted)} "
            f"(unexpected: {extra[:5]}, not converted: {missing[:5]})")
    logger.info("converted %d Linear layers to te.Linear on %s", len(converted), device)
    return list(layer_paths)


def _resolve_targets(model: nn.Module, layer_paths: Sequence[str]) -> dict[str, nn.Linear]:
    if len(set(layer_paths)) != len(layer_paths):
        dupes = sorted({p for p in layer_paths if list(layer_paths).count(p) > 1})
        raise ConversionError(f"layer paths listed more than once: {dupes[:5]}")
    paths_of: dict[int, list[str]] = {}
    modules: dict[str, nn.Module] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        paths_of.setdefault(id(module), []).append(path)
        modules[path] = module
    targets = {}
    for path in layer_paths:
        module = modules.get(path) if path else None
        if module is None:
            raise ConversionError(f"no module at path {path!r}; the analysis report does not match this model")
        # A Linear subclass with its own forward would lose that behaviour in te.Linear.
        if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
            raise ConversionError(f"{path!r} is a {type(module).__name__}, not an nn.Linear; cannot convert it")
        unlisted = sorted(set(paths_of[id(module)]) - set(layer_paths))
        if unlisted:
            raise ConversionError(f"the Linear at {path!r} is shared with {unlisted[:3]}; list all its paths or none")
        targets[path] = module
    return targets


def _te_linear_like(te: Any, old: nn.Linear, device: str | torch.device,
                    replaced: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> nn.Module:
    new = te.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                    params_dtype=old.weight.dtype, device=device)
    new.train(old.training)
    for name in ("weight", "bias"):
        src = getattr(old, name)
        if src is None:
            continue
        if id(src) in replaced:  # shared with a Linear converted earlier: share its TE parameter
            setattr(new, name, replaced[id(src)][1])
            continue
        dst = getattr(new, name)
        with torch.no_grad():
            dst.copy_(src)
        dst.requires_grad_(src.requires_grad)
        replaced[id(src)] = (src, dst)
    return new


def _retie(model: nn.Module, replaced: dict[int, tuple[nn.Parameter, nn.Parameter]]) -> None:
    """Point every module still holding a replaced parameter at its TE replacement."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False, remove_duplicate=False)):
            entry = replaced.get(id(param))
            if entry is not None and entry[0] is param:
                setattr(module, name, entry[1])
