"""Layer-sequential calibration: one decoder layer in memory at a time, whatever the model's size.

The model is built on the meta device. Three passes then run the calibration batches:

1. **Around the layers.** The modules outside the layer list (embeddings, rotary buffers, norms; not the
   output head) are loaded and every batch runs through the model with each layer replaced by a stand-in
   that records what the model hands it (hidden states, position embeddings, masks; per layer, since
   models with sliding-window layers pass each layer its own mask) and passes the hidden states on. The
   last stand-in stops the forward, so the head never runs here.
2. **Layer by layer.** Each layer is loaded, all cached batches go through it with the amax hooks on its
   eligible Linears, its outputs become the next layer's inputs, and it is released.
3. **The head**, only when an eligible Linear lies outside the layer list (``lm_head`` when the first/last
   rule is off): the model runs once more with the input embedding replaying its pass-1 outputs and the
   last layer returning its real outputs, so the final norm and head see exactly what the whole model
   would give them.

The computations are the ones the whole model performs, in the same order and dtype, so the amax per layer
and step equals whole-model calibration (bitwise on CPU in fp32, and for a half-precision checkpoint
computed in its own dtype). Two things make pass 2 fast:

* **Compute dtype.** On a CPU without native bf16 GEMMs a half-precision checkpoint's layers run in fp32,
  rounding as the half-precision model would (:mod:`converters.calibration.compute`); the job's choice and
  why are in :class:`SequentialStats`.
* **Prefetch.** While layer i runs, layer i+1's tensors are read from disk in a background thread
  (:mod:`converters.calibration.prefetch`), one layer ahead.

The replay machinery (:class:`LayerCalls`, :func:`record_layer_calls`, :func:`replaying_outer_modules`) lives in
:mod:`converters.calibration.layer_replay` and is re-exported here, for other layer-sequential passes (the quality
pass) to see the layers called exactly as calibration does; :func:`choose_compute` picks the dtype the replayed
calls run in and :func:`release_layer` puts a layer back on the meta device and hands its memory back to the system.

A ``boundary`` (:class:`LayerBoundary`, :mod:`converters.distributed`) makes the walk one rank of a data-parallel
job, or resumable: it picks this process's share of the steps, may skip the finished layers of a resume record
(:class:`Resumed`), and reduces and records each layer at its end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from converters.calibration.amax import AmaxRecorder, LayerAmax, amax_recorder, layer_done_for_sqnr
from converters.calibration.compute import (
    choose_compute_dtype,
    emulating,
    restore_dtypes,
    tensor_dtypes,
)
from converters.calibration.layer_replay import (
    LayerCalls,
    LayerStack,
    SequentialUnsupported,
    StopForward,
    module_path,
    record_layer_calls,
    replaying_outer_modules,
    under,
)
from converters.calibration.prefetch import LayerPrefetcher
from converters.errors import ConversionCancelled
from converters.model.checkpoint import Checkpoint, held_bytes, module_keys, release, return_freed_memory, unit_keys
from converters.model.experts import parse_unit_path

__all__ = [
    "LAYER_SEQUENTIAL",
    "WHOLE_MODEL",
    "LayerStack",
    "find_layer_stack",
    "choose_mode",
    "SequentialUnsupported",
    "LayerPass",
    "LayerBoundary",
    "Resumed",
    "LayerTiming",
    "SequentialStats",
    "calibrate_layer_by_layer",
    "LayerCalls",
    "StopForward",
    "record_layer_calls",
    "choose_compute",
    "replaying_outer_modules",
    "release_layer",
    "module_path",
    "under",
]


LAYER_SEQUENTIAL = "layer_sequential"
WHOLE_MODEL = "whole_model"


def find_layer_stack(model: nn.Module) -> tuple[LayerStack | None, str]:
    """The model's one list of repeated layers (classes named by ``_no_split_modules``), or None and why not."""
    classes = set(getattr(model, "_no_split_modules", None) or ())
    if not classes:
        return None, f"{type(model).__name__} declares no _no_split_modules layer classes"
    stacks = [
        (path, module) for path, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len(module) and all(type(m).__name__ in classes for m in module)
    ]
    if not stacks:
        return None, f"no module list of {sorted(classes)} layers in {type(model).__name__}"
    if len(stacks) > 1:
        return None, f"several layer lists ({', '.join(path for path, _ in stacks)}): encoder-decoder or multimodal"
    path, layers = stacks[0]
    return LayerStack(path=path, count=len(layers), layer_class=type(layers[0]).__name__), "ok"


def choose_mode(model: nn.Module, config: Any, *, backward: bool, te_extra_state: bool) -> tuple[
        LayerStack | None, str, str]:
    """``(stack, mode, reason)``: layer-sequential where the model's shape allows it, else the whole model."""
    if backward:
        return None, WHOLE_MODEL, "backward calibration back-propagates through the whole model"
    if te_extra_state:
        return None, WHOLE_MODEL, "te_extra_state asks TransformerEngine to serialize modules of the whole model"
    if getattr(config, "is_encoder_decoder", False):
        return None, WHOLE_MODEL, "encoder-decoder models run two layer lists"
    stack, why = find_layer_stack(model)
    if stack is None:
        return None, WHOLE_MODEL, why
    reason = f"{stack.count} {stack.layer_class} layers under {stack.path}, one in memory at a time"
    return stack, LAYER_SEQUENTIAL, reason


@dataclass
class LayerPass:
    """One calibrated layer, handed to ``after_layer`` before it is released."""

    index: int
    path: str
    layer: nn.Module
    linear_paths: list[str]  #: the eligible Linears inside it (model paths)
    amax: dict[str, LayerAmax] = field(repr=False)
    outputs: list[torch.Tensor] = field(repr=False)  #: its high-precision output per step
    #: ``call(module, step, hidden=None)`` runs step's call with the hidden states ``hidden`` (None: the layer's own
    #: inputs, ``inputs[step]``), so a callback may also run the layer on another stream of hidden states
    call: Callable[..., Any] = field(repr=False)
    inputs: list[torch.Tensor] = field(default_factory=list, repr=False)  #: its hidden-state input per step
    #: the job's step number of each of ``inputs`` (a rank of a data-parallel job runs a share of them), and how many
    #: steps the job has; empty: ``inputs`` are the job's steps 0, 1, ...
    steps: list[int] = field(default_factory=list)
    total_steps: int = 0


@dataclass(frozen=True)
class Resumed:
    """Where a resumed calibration picks up: the layers before ``next_layer`` are done and not run again."""

    next_layer: int
    amax: dict[str, LayerAmax]  #: what the finished layers recorded, in the order a whole run returns it
    hidden: list[torch.Tensor]  #: layer ``next_layer``'s input for each of this process's steps


class LayerBoundary(Protocol):
    """What a data-parallel or resumable walk does between layers (:mod:`converters.distributed`): which steps
    this process runs, where it resumes, and after each layer the reduction (``layer_done``, before ``after_layer``,
    which sees the reduced amax) and the record (``layer_finished``, after it), and the head's reduction."""

    world_size: int  #: the processes sharing the steps

    def steps(self, total: int) -> list[int]: ...

    def resume(self, layers: int) -> Resumed | None: ...

    def layer_done(self, index: int, recorder: AmaxRecorder, outputs: list[torch.Tensor]) -> None: ...

    def layer_finished(self, index: int) -> None: ...

    def head_done(self, recorder: AmaxRecorder) -> None: ...


@dataclass(frozen=True)
class LayerTiming:
    """Wall seconds of one layer in pass 2."""

    index: int
    wait_s: float  #: blocked on the prefetch thread's read of this layer (0 without prefetch)
    load_s: float  #: placing the tensors into the model (and reading them, without prefetch)
    forward_s: float  #: every calibration batch through the layer, amax hooks included


@dataclass
class SequentialStats:
    """What a layer-sequential calibration ran with; pass one to :func:`calibrate_layer_by_layer` to fill it."""

    compute_dtype: str = ""  #: e.g. ``float32``: the dtype the layer forwards ran in
    compute_reason: str = ""
    checkpoint_dtype: str = ""
    prefetch: bool = False
    layers: list[LayerTiming] = field(default_factory=list)
    resumed_at: int | None = None  #: the first layer run when a resume record held the earlier ones
    ranks: int = 1  #: processes that shared the calibration batches (torch.distributed ranks)

    def to_dict(self) -> dict[str, Any]:
        """The report block: dtypes, why, prefetch, the per-layer seconds summed, ranks and any resume."""
        totals = {key: round(sum(getattr(t, key) for t in self.layers), 3) for key in ("wait_s", "load_s", "forward_s")}
        resumed = {} if self.resumed_at is None else {"resumed_at_layer": self.resumed_at}
        return {"compute_dtype": self.compute_dtype, "compute_reason": self.compute_reason,
                "checkpoint_dtype": self.checkpoint_dtype, "prefetch": self.prefetch, **totals,
                "ranks": self.ranks, "layers_run": [timing.index for timing in self.layers], **resumed}

    def timeline(self) -> list[dict[str, Any]]:
        return [asdict(timing) for timing in self.layers]


def calibrate_layer_by_layer(
    model: nn.Module,
    stack: LayerStack,
    checkpoint: Checkpoint,
    batches: Sequence[dict[str, torch.Tensor]],
    layer_paths: Sequence[str],
    *,
    on_layer: Callable[[int, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    after_layer: Callable[[LayerPass], None] | None = None,
    compute_dtype: torch.dtype | None = None,
    prefetch: bool = True,
    stats: SequentialStats | None = None,
    boundary: LayerBoundary | None = None,
) -> dict[str, LayerAmax]:
    """Record the amax of ``layer_paths`` over ``batches`` with one layer of ``model`` in memory at a time.

    ``model`` is the meta-device model ``checkpoint`` loads into; every tensor is back on the meta device
    when this returns. ``on_layer(done, total)`` reports progress after each layer (and the head pass);
    ``should_stop()`` is checked before each layer and raises ConversionCancelled. ``after_layer`` sees each
    layer with its cached inputs and outputs before release (the TE check step uses it). ``boundary`` (a rank of a
    data-parallel job, or a resumable one) picks this process's share of the steps, may resume past finished
    layers, and reduces and records each layer as it ends; the amax returned are then the whole job's.

    ``compute_dtype`` is the dtype the layer forwards run in: None chooses (fp32 for a half-precision
    checkpoint on a CPU where a probe matmul runs clearly faster in fp32, else the checkpoint's dtype);
    the checkpoint's dtype forces the plain path (bit-identical to whole-model calibration in that dtype);
    ``torch.float32`` forces the fp32 path. ``prefetch`` reads layer i+1 from disk while layer i runs
    (the amax are the same either way). ``stats``, when given, receives the dtype chosen, why, and each
    layer's timing.

    Raises SequentialUnsupported when a layer returns something other than its hidden states (the caller
    falls back to whole-model calibration), and the load errors of :class:`Checkpoint`.
    """
    model.eval()
    layers: nn.ModuleList = model.get_submodule(stack.path)
    real = list(layers)
    head_path = module_path(model, model.get_output_embeddings())
    embed_path = module_path(model, model.get_input_embeddings())
    by_layer: dict[int | None, list[str]] = {}
    for path in layer_paths:
        by_layer.setdefault(stack.index_of(path), []).append(path)
    total = stack.count + (1 if None in by_layer else 0)
    steps = boundary.steps(len(batches)) if boundary is not None else list(range(len(batches)))
    passes = LayerCalls(stack.count, len(steps))
    passes.global_steps, passes.total_steps = steps, len(batches)
    inputs = [_to(batches[step], checkpoint.device) for step in steps]
    resumed = boundary.resume(stack.count) if boundary is not None else None
    first = resumed.next_layer if resumed is not None else 0
    stats = stats if stats is not None else SequentialStats()
    stats.prefetch, stats.checkpoint_dtype = prefetch, str(checkpoint.dtype).removeprefix("torch.")
    stats.resumed_at = first if resumed is not None else None
    stats.ranks = boundary.world_size if boundary is not None else 1
    prefetcher = LayerPrefetcher(checkpoint) if prefetch else None
    try:
        if prefetcher is not None and first < stack.count:
            prefetcher.start(first, module_keys(real[first], f"{stack.path}.{first}"))
        embedded = record_layer_calls(model, stack, checkpoint, inputs, passes, head_path, embed_path,
                                      keep_embeddings=None in by_layer)
        choose_compute(passes, checkpoint, compute_dtype, stats)
        if resumed is not None:
            passes.hidden_in = [hidden.to(checkpoint.device) for hidden in resumed.hidden]  # read to host memory
            if on_layer is not None and first:
                on_layer(first, total)
        for index in range(first, stack.count):
            if should_stop is not None and should_stop():
                raise ConversionCancelled(f"the conversion was cancelled before layer {index} of {stack.count}")
            if prefetcher is not None and index + 1 < stack.count:
                # Queued behind layer index's read on the one thread: at most one layer read ahead.
                prefetcher.start(index + 1, module_keys(real[index + 1], f"{stack.path}.{index + 1}"))
            take = (lambda i=index: prefetcher.take(i)) if prefetcher is not None else (lambda: None)
            stats.layers.append(_calibrate_layer(model, stack, checkpoint, passes, index, real[index],
                                                 by_layer.get(index, []), after_layer, take, boundary))
            if on_layer is not None:
                on_layer(index + 1, total)
        if None in by_layer:
            head = _run_head(model, stack, checkpoint, inputs, passes, by_layer[None], head_path, embed_path,
                             embedded)
            if boundary is not None:
                boundary.head_done(head)
            if on_layer is not None:
                on_layer(total, total)
    finally:
        if prefetcher is not None:
            prefetcher.close()
        for index, layer in enumerate(real):
            layers[index] = layer
        release(model)
    done = dict(resumed.amax) if resumed is not None else {}
    return done | {path: amax for recorder in passes.recorders for path, amax in recorder.results().items()}


def choose_compute(passes: LayerCalls, checkpoint: Checkpoint, requested: torch.dtype | None,
                    stats: SequentialStats) -> None:
    """Once per pass, after :func:`record_layer_calls`: the dtype replayed calls run in (see ``compute_dtype`` of
    :func:`calibrate_layer_by_layer`), set on ``passes`` and reported in ``stats``."""
    compute, why = choose_compute_dtype(requested, checkpoint.dtype, checkpoint.device)
    passes.compute = compute if compute != checkpoint.dtype else None
    stats.compute_dtype, stats.compute_reason = str(compute).removeprefix("torch."), why


def _calibrate_layer(model: nn.Module, stack: LayerStack, checkpoint: Checkpoint, passes: LayerCalls, index: int,
                     layer: nn.Module, paths: list[str], after_layer: Callable[[LayerPass], None] | None,
                     take: Callable[[], dict[str, torch.Tensor] | None], boundary: LayerBoundary | None = None
                     ) -> LayerTiming:
    """Pass 2 for one layer: load it, run every cached batch through it with the hooks on, release it.

    ``take()`` waits for the layer's on-disk tensors from the prefetch (None without one; only this frame holds
    them, so an upcast layer does not keep its half-precision copy alive).
    """
    started = time.perf_counter()
    tensors = take()
    read = time.perf_counter()
    layer_path = f"{stack.path}.{index}"
    layers: nn.ModuleList = model.get_submodule(stack.path)
    layers[index] = layer  # the real layer, so that its tensors load under their own names
    dtypes = tensor_dtypes(layer)
    checkpoint.load(unit_keys(model, lambda name: under(name, layer_path)), tensors=tensors)
    del tensors  # the layer's parameters hold them now
    loaded = time.perf_counter()
    recorder = amax_recorder(model, paths, passes.total_steps) if paths else AmaxRecorder({}, passes.total_steps)
    passes.recorders.append(recorder)
    outputs = []
    storage, compute = checkpoint.dtype, passes.compute or checkpoint.dtype
    # emulating() before attached(): its rounding hooks run first, so the recorder sees rounded tensors.
    with torch.no_grad(), emulating(layer, storage, compute), recorder.attached():
        for step, hidden in enumerate(passes.hidden_in):
            recorder.step = passes.global_steps[step]
            output = passes.call(layer, index, step, hidden)
            if not isinstance(output, torch.Tensor):
                raise SequentialUnsupported(
                    f"{stack.layer_class} returns a {type(output).__name__}, not its hidden states")
            outputs.append(output.to(storage))  # the hidden states between layers, rounded as the model rounds them
    forwarded = time.perf_counter()
    if boundary is not None:  # before release: the SQNR meter measures what it gathered with the layer's weights
        boundary.layer_done(index, recorder, outputs)
    if after_layer is not None:
        inputs = passes.hidden_in
        linear_paths = [path for path in paths if parse_unit_path(path) is None]  # experts are not swapped there
        after_layer(LayerPass(index=index, path=layer_path, layer=layer, linear_paths=linear_paths,
                              amax=recorder.results(), outputs=outputs, inputs=inputs,
                              steps=list(passes.global_steps), total_steps=passes.total_steps,
                              call=lambda module, step, hidden=None: passes.call(
                                  module, index, step, inputs[step] if hidden is None else hidden)))
    if boundary is not None:  # after after_layer: a resume record of the layer holds what that did (GPTQ's stream)
        boundary.layer_finished(index)
    layer_done_for_sqnr()  # this layer's Linears are not called again: their cast weights can go
    release_layer(layer, dtypes)
    passes.hidden_in = outputs
    return LayerTiming(index=index, wait_s=read - started, load_s=loaded - read, forward_s=forwarded - loaded)


def _run_head(model: nn.Module, stack: LayerStack, checkpoint: Checkpoint, inputs: list[dict], passes: LayerCalls,
              paths: list[str], head_path: str | None, embed_path: str | None, embedded: list[torch.Tensor]
              ) -> AmaxRecorder:
    """Pass 3: the modules after the layers see the last layer's real outputs; hooks on the outer Linears. Returns
    the recorder (its amax: the head's)."""
    keys = unit_keys(model, lambda name: under(name, head_path)) if head_path else set()
    checkpoint.load(keys)
    recorder = AmaxRecorder({path: model.get_submodule(path) for path in paths}, passes.total_steps)
    passes.recorders.append(recorder)
    with replaying_outer_modules(model, stack, passes, embedded, passes.hidden_in), torch.no_grad(), \
            recorder.attached():
        for step, batch in enumerate(inputs):
            passes.step, recorder.step = step, passes.global_steps[step]
            model(**batch)
    return recorder


def release_layer(layer: nn.Module, dtypes: dict[tuple[int, str], torch.dtype]) -> None:
    """Put ``layer``'s tensors back on the meta device in the dtypes ``dtypes`` (:func:`tensor_dtypes` before
    loading) and hand the freed heap pages back to the system (once a few layers' worth are freed: see
    :func:`return_freed_memory`): glibc keeps the freed pages of a layer's upcast copies in its arenas, so a pass
    that allocates per layer otherwise grows its resident memory with depth."""
    freed = held_bytes(layer)
    release(layer)
    restore_dtypes(layer, dtypes)
    return_freed_memory(freed)


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {key: value.to(device) if isinstance(value, torch.Tensor) else value for key, value in batch.items()}

