"""Calibration: record per-layer amax on CPU with hooks, and turn it into TE delayed-scaling state.

TransformerEngine's own calibration (``autocast(enabled=False, calibrating=True)``) only copies the
current batch's amax into row 0 and needs a real FP8 step on an sm89+ GPU to produce scales. Here the
amax of every calibration step is recorded with ordinary PyTorch hooks on the high-precision model and
the delayed-scaling update is replayed with :mod:`converters.calibration.scaling`, so a CPU machine can produce the
exact ``scale`` / ``amax_history`` that TE would hold after the same steps.
"""

from __future__ import annotations

import contextvars
import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from converters.calibration.experts import ExpertsRecorder
from converters.calibration.scaling import delayed_scaling_state, fp8_max_for
from converters.casts.emulation import max_abs
from converters.errors import CalibrationDataError, ConversionCancelled, RecipeError
from converters.model.experts import parse_unit_path
from converters.recipes import TEDelayedScalingRecipe

if TYPE_CHECKING:
    from converters.calibration.sqnr_meter import SqnrMeter

__all__ = [
    "FORWARD_SLOTS",
    "BACKWARD_SLOTS",
    "LayerAmax",
    "AmaxRecorder",
    "amax_recorder",
    "measuring_sqnr",
    "layer_done_for_sqnr",
    "record_amax",
    "te_scaling_state",
]


# The SQNR meter the recorders built inside measuring_sqnr() feed; a context, not an argument, because the
# layer-sequential driver (converters.calibration.sequential) builds a recorder per layer itself.
_SQNR_METER: contextvars.ContextVar[SqnrMeter | None] = contextvars.ContextVar("fp8forge_sqnr_meter", default=None)
# Column order of LayerAmax.forward / .backward: te.Linear's scaling_fwd (GEMM1_INPUT/WEIGHT/OUTPUT) and
# scaling_bwd (GRAD_OUTPUT1, GRAD_INPUT1) slots.
FORWARD_SLOTS = ("input", "weight", "output")
BACKWARD_SLOTS = ("grad_output", "grad_input")


@dataclass(frozen=True, kw_only=True)
class LayerAmax:
    """Amax of one Linear at each calibration step (fp32, CPU; 0 where the layer did not run)."""

    forward: torch.Tensor  #: ``[steps, 3]``: input, weight, output
    backward: torch.Tensor | None = None  #: ``[steps, 2]``: grad_output, grad_input; None if not recorded
    tokens: torch.Tensor | None = None  #: ``[steps]``: tokens routed to an expert GEMM unit; None for a Linear

    def __post_init__(self) -> None:
        if self.forward.dim() != 2 or self.forward.shape[1] != len(FORWARD_SLOTS):
            raise ValueError(f"forward must be [steps, 3], got {tuple(self.forward.shape)}.")
        if self.backward is not None and tuple(self.backward.shape) != (self.forward.shape[0], 2):
            raise ValueError(f"backward must be [{self.forward.shape[0]}, 2], got {tuple(self.backward.shape)}.")

    @property
    def steps(self) -> int:
        return int(self.forward.shape[0])



def layer_done_for_sqnr() -> None:
    """Tell the SQNR meter inside :func:`measuring_sqnr`, if any, that the layer-sequential calibration is done
    with a layer: the meter drops the cast weights it kept for that layer's calls."""
    meter = _SQNR_METER.get()
    if meter is not None:
        meter.drop_cast_weights()


@contextmanager
def measuring_sqnr(meter: SqnrMeter | None) -> Iterator[SqnrMeter | None]:
    """Inside the block, every recorder built (:func:`amax_recorder`, :class:`AmaxRecorder`) also feeds each
    hooked call to ``meter`` (``converters.calibration.sensitivity``), which accumulates the layer's quantization
    error."""
    token = _SQNR_METER.set(meter)
    try:
        yield meter
    finally:
        _SQNR_METER.reset(token)


def amax_recorder(model: nn.Module, layer_paths: Sequence[str], steps: int, *, backward: bool = False
                  ) -> AmaxRecorder:
    """A recorder for ``layer_paths``: Linear module paths and expert GEMM units (``converters.model.experts``).

    Raises CalibrationDataError for a path that is neither, and for no path at all.
    """
    if not layer_paths:
        raise CalibrationDataError("No layers to calibrate.", field="layer_paths")
    units = [path for path in layer_paths if parse_unit_path(path) is not None]
    experts = None
    if units:
        modules = {}
        for unit in units:
            module_path = parse_unit_path(unit).module
            try:
                modules[module_path] = model.get_submodule(module_path)
            except AttributeError as exc:
                raise CalibrationDataError(f"The model has no experts module {module_path!r}.",
                                           field="layer_paths") from exc
        experts = ExpertsRecorder(modules, units, steps, sqnr=_SQNR_METER.get(), backward=backward)
    linears = _resolve_layers(model, [path for path in layer_paths if parse_unit_path(path) is None])
    return AmaxRecorder(linears, steps, backward=backward, experts=experts)


def _resolve_layers(model: nn.Module, layer_paths: Sequence[str]) -> dict[str, nn.Linear]:
    layers = {}
    for path in layer_paths:
        try:
            module = model.get_submodule(path)
        except AttributeError as exc:
            raise CalibrationDataError(f"The model has no module {path!r}.", field="layer_paths") from exc
        # te.Linear is not an nn.Linear subclass but has the same weight layout; accept any linear-shaped module.
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise CalibrationDataError(
                f"{path} is a {type(module).__name__}, not a Linear layer; only Linear layers are calibrated.",
                field="layer_paths",
            )
        layers[path] = module
    return layers


def _amax(tensor: Any) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
        return torch.zeros((), dtype=torch.float32)
    return max_abs(tensor.detach()).float().cpu()


def _backward_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Language-model loss when the model takes ``labels``, else the mean of the logits."""
    accepts_labels = "labels" in inspect.signature(model.forward).parameters
    if accepts_labels:
        # -100 is the ignore index of HF causal-LM losses; padding must not count.
        labels = batch["input_ids"]
        if "attention_mask" in batch:
            labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
        out = model(**batch, labels=labels)
        if getattr(out, "loss", None) is not None:
            return out.loss
    else:
        out = model(**batch)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.float().mean()


class AmaxRecorder:
    """Hooks that record the amax of Linear layers at each calibration step.

    Forward hooks record input, weight and output amax; with ``backward=True`` full backward hooks also
    record grad_output and grad_input (the Linear's own dgrad, not the sum over sibling layers). A layer
    called several times in one step keeps the maximum, as TE's quantizer does; a layer not called keeps 0.
    Inside :func:`measuring_sqnr` the forward hooks also hand each call's input, weight and bias to the meter.
    The caller sets :attr:`step` before each step; hooks exist only inside :meth:`attached`.
    """

    def __init__(self, layers: dict[str, nn.Module], steps: int, *, backward: bool = False,
                 experts: ExpertsRecorder | None = None) -> None:
        self.layers = layers
        self.experts = experts
        self.sqnr = _SQNR_METER.get()
        if self.sqnr is not None:
            self.sqnr.expect_steps(steps)
        self._step = 0
        self.forward = {path: torch.zeros(steps, len(FORWARD_SLOTS)) for path in layers}
        self.backward = {path: torch.zeros(steps, len(BACKWARD_SLOTS)) for path in layers} if backward else None

    @property
    def step(self) -> int:
        return self._step

    @step.setter
    def step(self, value: int) -> None:
        self._step = value
        if self.experts is not None:
            self.experts.step = value

    def _forward_hook(self, path: str) -> Callable:
        weight_amax: list[torch.Tensor] = []  # the weight does not change during calibration: one pass over it

        def hook(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not weight_amax:
                weight_amax.append(_amax(module.weight))
            measured = self.sqnr is not None and args and isinstance(args[0], torch.Tensor)
            # with the meter on, one pass gives each token row's amax (the meter picks its rows from them), once
            # for the Linears that share an input
            input_amax = _amax(args[0] if args else None) if not measured else \
                torch.tensor(self.sqnr.input_rows(args[0], module.weight.shape[1], self.step).amax)
            values = torch.stack([input_amax.float().cpu(), weight_amax[0], _amax(output)])
            self.forward[path][self.step] = torch.fmax(self.forward[path][self.step], values)
            if measured:
                bias = getattr(module, "bias", None)
                bias = bias if isinstance(bias, torch.Tensor) and bias.numel() == module.weight.shape[0] else None
                self.sqnr.observe(path, self.step, args[0], module.weight, bias, output)

        return hook

    def _backward_hook(self, path: str) -> Callable:
        def hook(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
            values = torch.stack([_amax(grad_output[0]), _amax(grad_input[0])])
            self.backward[path][self.step] = torch.fmax(self.backward[path][self.step], values)

        return hook

    @contextmanager
    def attached(self) -> Iterator[AmaxRecorder]:
        """Register the hooks for the duration of the block; they are removed even on error."""
        handles = []
        try:
            for path, module in self.layers.items():
                handles.append(module.register_forward_hook(self._forward_hook(path)))
                if self.backward is not None:
                    handles.append(module.register_full_backward_hook(self._backward_hook(path)))
            for module, hook in self.experts.hooks() if self.experts is not None else ():
                handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
            for module, hook in self.experts.gradient_hooks() if self.experts is not None else ():
                handles.append(module.register_forward_hook(hook, with_kwargs=True))
            yield self
        finally:
            for handle in handles:
                handle.remove()

    def results(self) -> dict[str, LayerAmax]:
        backward = self.backward or {}
        results = {path: LayerAmax(forward=self.forward[path], backward=backward.get(path)) for path in self.layers}
        if self.experts is not None:
            grads = self.experts.backward or {}
            results.update({unit: LayerAmax(forward=forward, backward=grads.get(unit),
                                            tokens=self.experts.tokens_per_step(unit))
                            for unit, forward in self.experts.forward.items()})
        return results


def record_amax(
    model: nn.Module,
    layer_paths: Sequence[str],
    batches: Sequence[dict[str, torch.Tensor]],
    *,
    backward: bool = False,
    on_step: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> dict[str, LayerAmax]:
    """Run ``batches`` through ``model`` and record the amax of each listed ``nn.Linear`` per step.

    See :class:`AmaxRecorder` for what is recorded. With ``backward=True`` a loss (``labels=input_ids`` LM
    loss, else logits mean) is back-propagated; no optimizer step is taken and parameter ``.grad`` are set
    to None after every step (earlier grads are discarded). Without backward the model runs under
    ``torch.no_grad()``. The model runs in eval mode (no dropout) in its own dtype and device; its training
    flag is restored afterwards and every hook is removed, even on error.

    ``on_step(done, total)`` is called after each step; ``should_stop()`` is checked before each step and
    raises ConversionCancelled when it returns True. Raises CalibrationDataError for unknown or
    non-Linear ``layer_paths`` or an empty ``batches``.
    """
    total = len(batches)
    if total == 0:
        raise CalibrationDataError("No calibration batches.", field="batches")
    recorder = amax_recorder(model, layer_paths, total, backward=backward)
    was_training = model.training
    device = next(model.parameters()).device
    try:
        model.eval()
        with recorder.attached():
            for step in range(total):
                if should_stop is not None and should_stop():
                    raise ConversionCancelled(f"Calibration stopped after {step} of {total} steps.")
                recorder.step = step
                batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batches[step].items()}
                if backward:
                    _backward_step(model, batch)
                else:
                    with torch.no_grad():
                        model(**batch)
                if on_step is not None:
                    on_step(step + 1, total)
    finally:
        model.train(was_training)
    return recorder.results()


def _backward_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    with torch.enable_grad():
        loss = _backward_loss(model, batch)
        if not loss.requires_grad:
            raise CalibrationDataError(
                "Backward calibration needs a model whose parameters require grad "
                "(none do, so no gradient reaches the layers).",
                field="backward",
            )
        loss.backward()
    model.zero_grad(set_to_none=True)


def te_scaling_state(
    layer_amax: LayerAmax,
    recipe: TEDelayedScalingRecipe,
    *,
    fp8_output: bool = False,
    fp8_grad: bool = False,
) -> dict[str, torch.Tensor]:
    """The delayed-scaling state a ``te.Linear`` holds after the recorded steps.

    Returns ``scale_fwd [3]``, ``amax_history_fwd [L, 3]``, ``scale_bwd [2]``, ``amax_history_bwd [L, 2]``
    (fp32, ``L = recipe.amax_history_len``), computed with :func:`converters.calibration.scaling.delayed_scaling_state`.

    te.Linear casts its output only when called with ``fp8_output=True`` and its grad_input only with
    ``fp8_grad=True`` (``Linear._get_quantizers`` in TE 2.20); otherwise those slots are never written,
    so by default their history stays zero and their scale one, as in TE. When no backward was
    recorded the whole backward state is zeros / ones: TE's initial state, still valid because it is
    first refreshed after the first real backward pass.
    Raises RecipeError if ``recipe`` is not a TEDelayedScalingRecipe.
    """
    if not isinstance(recipe, TEDelayedScalingRecipe):
        raise RecipeError(
            f"TE scaling state needs a delayed-scaling recipe, got {type(recipe).__name__}.", field="scaling"
        )
    common = {
        "history_len": recipe.amax_history_len,
        "algo": recipe.amax_compute_algo.value,
        "margin": recipe.margin,
    }
    fwd = layer_amax.forward.clone()
    if not fp8_output:
        fwd[:, FORWARD_SLOTS.index("output")] = 0.0
    scale_fwd, hist_fwd = delayed_scaling_state(fwd, fp8_max=fp8_max_for(recipe.fp8_format, "forward"), **common)
    if layer_amax.backward is None:
        scale_bwd = torch.ones(len(BACKWARD_SLOTS), dtype=torch.float32)
        hist_bwd = torch.zeros(recipe.amax_history_len, len(BACKWARD_SLOTS), dtype=torch.float32)
    else:
        bwd = layer_amax.backward.clone()
        if not fp8_grad:
            bwd[:, BACKWARD_SLOTS.index("grad_input")] = 0.0
        scale_bwd, hist_bwd = delayed_scaling_state(bwd, fp8_max=fp8_max_for(recipe.fp8_format, "backward"), **common)
    return {
        "scale_fwd": scale_fwd,
        "amax_history_fwd": hist_fwd,
        "scale_bwd": scale_bwd,
        "amax_history_bwd": hist_bwd,
    }
