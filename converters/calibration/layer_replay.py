"""The replay machinery of layer-sequential passes: record what each layer of a model is called with, then call a
layer (or the modules around the layers) again with it, one layer in memory at a time.

Calibration (:mod:`converters.calibration.sequential`) and the quality pass (:mod:`converters.quality.measure`) use
it to see the layers called exactly as the whole model calls them: :class:`LayerCalls` holds what
:func:`record_layer_calls` recorded and runs a layer on new hidden states (:meth:`LayerCalls.call`, in the dtype
``choose_compute`` picked); :func:`replaying_outer_modules` runs the model's forward around its layers again with the
input embedding and the last layer's output replayed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from converters.calibration.amax import AmaxRecorder
from converters.calibration.compute import cast_floats
from converters.model.checkpoint import Checkpoint, release, unit_keys

__all__ = ["SequentialUnsupported", "LayerStack", "StopForward", "LayerCalls", "record_layer_calls",
           "replaying_outer_modules", "module_path", "under"]


class SequentialUnsupported(Exception):
    """The model does not fit the layer-sequential shape; the pipeline falls back to the whole model."""


@dataclass(frozen=True)
class LayerStack:
    """The module list that holds a model's decoder (or encoder) layers."""

    path: str  #: e.g. ``model.layers``
    count: int
    layer_class: str

    def index_of(self, name: str) -> int | None:
        """The layer a module or tensor path belongs to, or None when it lies outside the list."""
        prefix = f"{self.path}."
        if not name.startswith(prefix):
            return None
        head = name[len(prefix):].partition(".")[0]
        return int(head) if head.isdigit() else None


class StopForward(Exception):
    """Raised inside a model's forward to end it early (after the last layer's call is recorded; or by a hook)."""


class _LayerStandIn(nn.Module):
    """Takes a layer's place while the model runs around its layers; see the module docstring."""

    def __init__(self, index: int, real: nn.Module, passes: LayerCalls) -> None:
        super().__init__()
        # Plain attributes, not submodules: the stand-in must not expose the real layer's tensors.
        self.__dict__["_real"] = real
        self.__dict__["_passes"] = passes
        self.__dict__["_index"] = index

    def __getattr__(self, name: str) -> Any:
        # Models read layer attributes in their loop (e.g. ``decoder_layer.attention_type``).
        return getattr(self.__dict__["_real"], name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._passes.layer_called(self._index, args, kwargs)


class _Replay(nn.Module):
    """Returns the recorded output of a module for the current step, without its weights."""

    def __init__(self, outputs: list[Any], passes: LayerCalls) -> None:
        super().__init__()
        self.__dict__["_outputs"] = outputs
        self.__dict__["_passes"] = passes

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._outputs[self._passes.step]


class LayerCalls:
    """What each layer of a model is called with, per step (batch), recorded by :func:`record_layer_calls`.

    ``hidden_in[step]`` is the first layer's hidden-state input; ``call(layer, index, step, hidden)`` runs layer
    ``index`` on new hidden states with that step's other recorded arguments (position embeddings, masks).
    ``compute`` (set by :func:`choose_compute`) is the dtype the replayed calls run in. During
    :func:`replaying_outer_modules`, ``final[step]`` is what the last layer returns.
    """

    def __init__(self, count: int, steps: int) -> None:
        self.count = count
        self.step = 0
        #: the calibration step (recorders' row) of each of these steps: a rank runs a share of a job's steps
        self.global_steps = list(range(steps))
        self.total_steps = steps
        self.replaying = False
        self.calls: list[list[tuple[tuple, dict] | None]] = [[None] * steps for _ in range(count)]
        self.hidden_in: list[torch.Tensor | None] = [None] * steps
        self.hidden_key: str | None = None
        self.final: list[torch.Tensor] = []
        self.recorders: list[AmaxRecorder] = []
        self.compute: torch.dtype | None = None  #: pass 2 casts each layer's inputs to it when set

    def layer_called(self, index: int, args: tuple, kwargs: dict) -> Any:
        if args:
            hidden, rest = args[0], args[1:]
        else:
            self.hidden_key = "hidden_states"
            kwargs = dict(kwargs)
            hidden, rest = kwargs.pop("hidden_states"), ()
        if self.replaying:
            return self.final[self.step] if index == self.count - 1 else hidden
        self.calls[index][self.step] = (rest, kwargs)
        if index == 0:
            self.hidden_in[self.step] = hidden
        if index == self.count - 1:
            raise StopForward
        return hidden

    def call(self, layer: nn.Module, index: int, step: int, hidden: torch.Tensor) -> Any:
        """Layer ``index``'s output for ``hidden`` (its input), called as the model called it at ``step``."""
        rest, kwargs = self.calls[index][step]
        if self.compute is not None and hidden.dtype != self.compute:
            # Upcasts only (the recorded inputs are in the checkpoint's dtype): exact.
            hidden, rest, kwargs = (cast_floats(value, self.compute) for value in (hidden, rest, kwargs))
        if self.hidden_key is None:
            return layer(hidden, *rest, **kwargs)
        return layer(*rest, **{self.hidden_key: hidden}, **kwargs)


def record_layer_calls(model: nn.Module, stack: LayerStack, checkpoint: Checkpoint, inputs: list[dict],
                       passes: LayerCalls, head_path: str | None, embed_path: str | None,
                       keep_embeddings: bool) -> list[torch.Tensor]:
    """Pass 1: load what lies outside the layers (not the head), record each layer's call into ``passes``, release
    the input embedding and the head; the real layers are back in place on return. Returns the input embedding's
    output per step when ``keep_embeddings`` (for :func:`replaying_outer_modules`), else an empty list. Raises
    SequentialUnsupported when the forward does not reach the last layer."""
    checkpoint.load(unit_keys(model, lambda name: stack.index_of(name) is None and not under(name, head_path)))
    layers: nn.ModuleList = model.get_submodule(stack.path)
    real = list(layers)
    for index, layer in enumerate(real):
        layers[index] = _LayerStandIn(index, layer, passes)
    embedded: list[torch.Tensor] = []
    embedding = model.get_submodule(embed_path) if embed_path else None
    hook = embedding.register_forward_hook(lambda _m, _a, out: embedded.append(out)) \
        if keep_embeddings and embedding is not None else None
    try:
        with torch.no_grad():
            for step, batch in enumerate(inputs):
                passes.step = step
                try:
                    model(**batch)
                except StopForward:
                    pass
                if passes.calls[-1][step] is None:
                    raise SequentialUnsupported(f"{type(model).__name__}'s forward did not call every layer")
    finally:
        if hook is not None:
            hook.remove()
        for index, layer in enumerate(real):
            layers[index] = layer
    for path in (embed_path, head_path):
        if path:
            release(model.get_submodule(path))
    return embedded


@contextmanager
def replaying_outer_modules(model: nn.Module, stack: LayerStack, passes: LayerCalls, embedded: list[Any],
                            final: list[torch.Tensor]) -> Iterator[None]:
    """Inside the block, the model's forward at ``passes.step`` runs only the modules outside its layers: the input
    embedding returns ``embedded[step]`` (no weight needed), each layer hands its hidden states on and the last
    returns ``final[step]``. The caller loads the modules after the layers (final norm, head) and sets
    ``passes.step`` per step; the real layers and embedding are back in place on exit."""
    layers: nn.ModuleList = model.get_submodule(stack.path)
    real = list(layers)
    embed_path = module_path(model, model.get_input_embeddings())
    parent, _, leaf = (embed_path or "").rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    original = getattr(owner, leaf) if embed_path else None
    passes.final, passes.replaying = final, True
    for index in range(stack.count):
        layers[index] = _LayerStandIn(index, real[index], passes)
    if embed_path:
        setattr(owner, leaf, _Replay(embedded, passes))
    try:
        yield
    finally:
        passes.replaying = False
        if embed_path:
            setattr(owner, leaf, original)
        for index, layer in enumerate(real):
            layers[index] = layer


def module_path(model: nn.Module, module: nn.Module | None) -> str | None:
    """The path of ``module`` inside ``model`` (None for None or a module not in it)."""
    if module is None:
        return None
    return next((path for path, candidate in model.named_modules() if candidate is module), None)


def under(name: str, path: str | None) -> bool:
    """Whether the module or tensor path ``name`` is ``path`` or lies inside it (False for a None path)."""
    return path is not None and (name == path or name.startswith(f"{path}."))
