"""TransformerEngine backend: swap ``nn.Linear`` for ``te.Linear`` and carry delayed-scaling state.

TransformerEngine (TE) needs CUDA; it cannot be installed or imported on a machine without it. This module
therefore imports only torch and our own modules at module level: every function that needs TE calls
:func:`require_te` first (so a CPU machine gets a :class:`BackendUnavailableError` before any work) and
imports TE inside the function.

Written against TE 2.x source (checked at the 2.20 development head and tags v2.0, v2.5, v2.8, v2.10,
v2.14, v2.18). The TE attributes used, all in ``transformer_engine/pytorch``:

* ``module/base.py`` ``TransformerEngineBaseModule``: ``fp8_meta["scaling_fwd"]`` /
  ``fp8_meta["scaling_bwd"]`` hold a ``DelayedScalingRecipeState`` (``quantization.py``; ``fp8.py``
  before 2.10) whose ``.scale`` is fp32 ``[num_gemms*3]`` (fwd) / ``[num_gemms*2]`` (bwd) and
  ``.amax_history`` fp32 ``[amax_history_len, n]``. Its ``Float8Quantizer`` objects hold *views* of those
  tensors, and ``FP8GlobalStateManager`` keeps references to them in its reduction buffers, so state is
  written with in-place ``copy_`` (as TE's own ``set_extra_state`` does), never by rebinding.
* ``init_fp8_metadata(num_gemms=1)`` run inside ``autocast(enabled=False, calibrating=True, recipe=r)``
  sets ``fp8_meta["recipe"] = r``, ``num_gemms``, ``fp8_max_fwd/bwd`` and allocates the state through
  ``init_fp8_meta_tensors`` -> ``set_meta_tensor``; with ``enabled=False`` no FP8-capable GPU is needed
  and the autocast exit runs no amax/scale update. If the module already holds delayed-scaling state,
  ``set_meta_tensor`` keeps it and only resizes the history (``adjust_amax_history_length``).
* ``get_extra_state()``: TE's pickled ``_extra_state`` (``{"recipe", "scale_fwd", "amax_history_fwd",
  "scale_bwd", "amax_history_bwd", "extra_fp8_variables"}``), written only when
  ``fp8_meta["fp8_checkpoint"]`` (or ``module.fp8`` / ``module.fp8_calibration``) is true.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from converters.errors import BackendUnavailableError, ConversionError, RecipeError
from converters.recipes import TECurrentScalingRecipe, TEDelayedScalingRecipe
from converters.te_layout import TE_STATE_NAMES

__all__ = [
    "TE_INSTALL_HINT",
    "te_status",
    "require_te",
    "build_te_recipe",
    "convert_to_te",
    "check_state_tensors",
    "apply_scaling_state",
    "read_scaling_state",
    "fp8_check_step",
    "te_extra_state_tensor",
]

logger = logging.getLogger(__name__)

TE_INSTALL_HINT = (
    "Run this job on a GPU worker (CUDA; FP8 execution needs compute capability 8.9 or newer), or install "
    "TransformerEngine on a CUDA machine with a CUDA build of torch: "
    "pip install --no-build-isolation 'transformer_engine[pytorch]'"
)

# Slots per te.Linear (one GEMM): forward input, weight, output; backward grad_output, grad_input.
_N_FWD, _N_BWD = 3, 2
_META_KEYS = {"scale_fwd": ("scaling_fwd", "scale"), "amax_history_fwd": ("scaling_fwd", "amax_history"),
              "scale_bwd": ("scaling_bwd", "scale"), "amax_history_bwd": ("scaling_bwd", "amax_history")}


# --- availability ---------------------------------------------------------------------------------

def te_status() -> tuple[bool, str]:
    """Whether TE can run here: a CUDA device is visible and ``transformer_engine.pytorch`` imports.

    Returns ``(True, "TransformerEngine <version> on <device>")`` or ``(False, message)`` where the
    message names what is missing and how to fix it. Never raises. TE is imported only when CUDA is
    present (without CUDA its import fails while loading its libraries).
    """
    problems = []
    if not torch.cuda.is_available():
        problems.append(f"no CUDA device is visible to torch {torch.__version__} "
                        f"(torch.version.cuda={torch.version.cuda})")
    if importlib.util.find_spec("transformer_engine") is None:
        problems.append("the transformer_engine package is not installed")
    elif not problems:
        try:
            importlib.import_module("transformer_engine.pytorch")
        except Exception as exc:  # TE raises ImportError, OSError or RuntimeError for missing CUDA libraries
            problems.append(f"transformer_engine.pytorch failed to import ({type(exc).__name__}: {exc})")
    if problems:
        return False, f"TransformerEngine backend unavailable: {'; '.join(problems)}. {TE_INSTALL_HINT}"
    te_root = importlib.import_module("transformer_engine")
    version = getattr(te_root, "__version__", "unknown version")
    return True, f"TransformerEngine {version} on {torch.cuda.get_device_name()}"


def require_te() -> None:
    """Raise BackendUnavailableError (message from :func:`te_status`) unless TE can run here."""
    ok, message = te_status()
    if not ok:
        raise BackendUnavailableError(message, field="backend")


def _te() -> Any:
    """``transformer_engine.pytorch`` after :func:`require_te`."""
    require_te()
    return importlib.import_module("transformer_engine.pytorch")


def _autocast(te: Any, *, enabled: bool, recipe: Any, calibrating: bool = False) -> AbstractContextManager:
    """``te.autocast`` (TE >= 2.10) or the older ``te.fp8_autocast`` (deprecated since 2.10)."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=enabled, calibrating=calibrating, recipe=recipe)
    return te.fp8_autocast(enabled=enabled, calibrating=calibrating, fp8_recipe=recipe)


def _require_fp8_execution(te: Any) -> None:
    """Raise BackendUnavailableError when this GPU cannot run FP8 GEMMs (TE asserts this on autocast)."""
    if hasattr(te, "is_fp8_available"):  # TE >= 2.10
        ok, reason = te.is_fp8_available(return_reason=True)
    else:
        ok, reason = importlib.import_module("transformer_engine.pytorch.fp8").check_fp8_support()
    if not ok:
        raise BackendUnavailableError(
            f"this GPU cannot run TransformerEngine FP8 ({reason}); run the job on an Ada, Hopper or newer "
            "GPU worker (compute capability 8.9+)", field="backend")


# --- recipes --------------------------------------------------------------------------------------

def build_te_recipe(recipe: TEDelayedScalingRecipe | TECurrentScalingRecipe) -> Any:
    """TE's ``DelayedScaling`` or ``Float8CurrentScaling`` for one of our TE recipes (fields map 1:1).

    Raises BackendUnavailableError without CUDA/TE (or, for current scaling, with TE < 2.2), RecipeError for a
    recipe of another backend.
    """
    if not isinstance(recipe, (TEDelayedScalingRecipe, TECurrentScalingRecipe)):
        raise RecipeError(f"the TransformerEngine backend needs a te recipe, got {type(recipe).__name__}",
                          field="backend")
    require_te()
    te_recipe = importlib.import_module("transformer_engine.common.recipe")
    kwargs = recipe.te_recipe_kwargs()
    kwargs["fp8_format"] = getattr(te_recipe.Format, kwargs["fp8_format"])
    name = "DelayedScaling" if isinstance(recipe, TEDelayedScalingRecipe) else "Float8CurrentScaling"
    if not hasattr(te_recipe, name):  # Float8CurrentScaling arrived in TE 2.2
        raise BackendUnavailableError(f"this TransformerEngine has no {name} recipe; upgrade it to 2.2 or newer: "
                                      "pip install --no-build-isolation -U 'transformer_engine[pytorch]'",
                                      field="backend")
    return getattr(te_recipe, name)(**kwargs)


# --- module swap ----------------------------------------------------------------------------------

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
    te = _te()
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


# --- scaling state --------------------------------------------------------------------------------

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
    te = _te()
    if not isinstance(recipe, TEDelayedScalingRecipe):
        raise ConversionError(f"only delayed scaling carries state; got a {type(recipe).__name__}")
    modules = {path: _te_linear_at(te, model, path) for path in states}
    for path, tensors in states.items():
        check_state_tensors(path, tensors, recipe.amax_history_len)
    with _autocast(te, enabled=False, calibrating=True, recipe=build_te_recipe(recipe)):
        for module in modules.values():
            module.init_fp8_metadata(num_gemms=1)
    for path, module in modules.items():
        _write_state(path, module, states[path])


def read_scaling_state(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """The delayed-scaling state of every te.Linear that holds one, as CPU float32 copies (te_layout names).

    te.Linear modules without delayed-scaling state (never initialised, or current scaling) are left out.
    Raises BackendUnavailableError without CUDA/TE.
    """
    te = _te()
    states = {}
    for path, module in model.named_modules():
        if isinstance(module, te.Linear) and _has_delayed_state(module):
            states[path] = {name: _meta_tensor(module, name).detach().to("cpu", torch.float32, copy=True)
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


def _has_delayed_state(module: nn.Module) -> bool:
    fwd, bwd = module.fp8_meta.get("scaling_fwd"), module.fp8_meta.get("scaling_bwd")
    return all(isinstance(getattr(s, "amax_history", None), torch.Tensor) for s in (fwd, bwd))


def _meta_tensor(module: nn.Module, name: str) -> torch.Tensor:
    meta_key, attr = _META_KEYS[name]
    return getattr(module.fp8_meta[meta_key], attr)


def _write_state(path: str, module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """In-place copy: TE's quantizers and global amax buffers hold views of these very tensors."""
    if not _has_delayed_state(module):
        raise ConversionError(f"{path}: TE did not create delayed-scaling state for this module")
    with torch.no_grad():
        for name in TE_STATE_NAMES:
            dst = _meta_tensor(module, name)
            if dst.shape != tensors[name].shape:
                raise ConversionError(f"{path}.{name}: TE holds shape {tuple(dst.shape)}, "
                                      f"the state has {tuple(tensors[name].shape)}")
            dst.copy_(tensors[name].to(dtype=dst.dtype))


# --- FP8 check step -------------------------------------------------------------------------------

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
    te = _te()
    _require_fp8_execution(te)
    before = _check_step_preconditions(te, model, batch, recipe)
    te_recipe = build_te_recipe(recipe)
    device = next(model.parameters()).device
    inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    grads = {p: p.grad for p in model.parameters()}
    from converters.backends.te_layer_check import rows_padded

    try:
        with torch.enable_grad(), rows_padded(te, model):
            with _autocast(te, enabled=True, recipe=te_recipe):
                outputs = model(**inputs)
                step_amax = {p: _meta_tensor(model.get_submodule(p), "amax_history_fwd")[0].tolist() for p in before}
            loss = _check_step_loss(outputs)
            if loss.requires_grad:
                loss.backward()
        after = read_scaling_state(model)
    finally:
        for param, grad in grads.items():
            param.grad = grad
        for path, tensors in before.items():
            _write_state(path, model.get_submodule(path), tensors)
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


# --- TE's own extra state -------------------------------------------------------------------------

def te_extra_state_tensor(module: nn.Module) -> torch.Tensor:
    """TE's own ``_extra_state`` of a te.Linear (``module.get_extra_state()``): a uint8 CPU tensor holding a
    pickle, for the opt-in ``te_extra_state: true`` artifact mode. Loading it needs
    ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` on TE >= 2.18; our default artifact carries plain tensors.

    TE writes the state only while ``fp8_meta["fp8_checkpoint"]`` is set, and clears that flag after any
    forward outside an FP8 autocast; a module holding delayed-scaling state gets the flag set again here.
    Raises BackendUnavailableError without CUDA/TE; ConversionError for a non-te.Linear module, or when
    TE returns an empty state for a module that holds delayed-scaling state.
    """
    te = _te()
    if not isinstance(module, te.Linear):
        raise ConversionError(f"expected a te.Linear, got {type(module).__name__}")
    stateful = _has_delayed_state(module)
    if stateful:
        module.fp8_meta["fp8_checkpoint"] = True
    state = module.get_extra_state()
    if stateful and state.numel() == 0:
        raise ConversionError("TransformerEngine returned an empty _extra_state for a module with scaling state")
    return state
