"""NVFP4 smoothing in the calibration's layer walk: per decoder layer, each mapping's per-input-channel scales
searched on the layer's calibration inputs (:func:`~converters.serving.nvfp4_smoothing.search_smoothing`) and
folded into the layer, the changed tensors written to one file per layer (one layer in memory, as the walk).

A mapping is what feeds a Linear group and the group: an RMSNorm and the q/k/v or gate/up it feeds, ``up_proj``
and ``down_proj`` (a gated MLP multiplies ``up``'s output into ``down``'s input), ``v_proj`` and ``o_proj`` where
their shapes match (not under grouped-query attention). A mapping is smoothed only where every Linear of its group
is eligible (one left in high precision gains nothing from it), and only where the fold is checked to leave the
layer computing what it did: a norm must scale its output channels by its weight (the fold divides the weight),
and the layer's output on a calibration step must not move by more than :data:`FOLD_TOLERANCE` (the dtype's
rounding moves it by ~0.1-0.5%). Anything else is left as it is, with the reason in the layer's record.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from converters.calibration.sequential import LayerPass
from converters.serving.nvfp4_smoothing import RATIO_STEPS, SearchShare, fold_scales, search_smoothing

__all__ = ["FOLD_TOLERANCE", "MAPPINGS", "SAMPLE_ROWS", "RankShare", "SmoothingWalk"]

#: (what feeds the group, the group) inside one decoder layer, as AWQ maps a Llama-style layer
MAPPINGS = (("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
            ("mlp.up_proj", ("mlp.down_proj",)),
            ("self_attn.v_proj", ("self_attn.o_proj",)))
SAMPLE_ROWS = 2048  #: calibration token rows each mapping's error is measured on (spread over the steps, seeded)
FOLD_TOLERANCE = 0.02  #: the most a fold may move the layer's output (relative RMS) before it is undone
_SEED_STRIDE = 1_000_003  #: a step's draw in layer i is seeded i * stride + step (steps are fewer than this)


@dataclass(frozen=True)
class RankShare:
    """How the ranks of a data-parallel job share the walk (:mod:`converters.distributed` builds it): ``rows`` gives
    every rank each Linear's sampled rows of every rank (concatenated in rank order, the job's step order: the rows
    the one-process walk samples, each step's draw being seeded by the layer and the step), ``search`` splits each
    mapping's candidates among the ranks, and rank 0 (``leader``) alone folds, checks and writes."""

    leader: bool
    rows: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    search: SearchShare


def _layer_file(directory: Path, index: int) -> Path:
    """Where the walk writes layer ``index``'s changed tensors (model parameter names)."""
    return directory / f"layer-{index}.safetensors"


@dataclass
class SmoothingWalk:
    """The walk's ``after_layer``: smooths each layer's mappings and writes what changed to ``directory``.

    ``eligible``: the model paths of the Linears the job converts; ``dtype``: the checkpoint's. ``records``
    collects one entry per mapping found (smoothed, kept or skipped, with why and the errors); ``changed`` every
    tensor written, by model name, with the file that holds it.

    ``share``: on a rank of a data-parallel job, which walks its share of the steps, how the ranks share the rest
    (:class:`RankShare`).
    """

    eligible: set[str]
    directory: Path | None  #: None: a rank other than rank 0 (``share``), which writes nothing
    dtype: torch.dtype  #: the checkpoint's: folded tensors are rounded to it (the layer may run upcast)
    steps: int = RATIO_STEPS
    rows: int = SAMPLE_ROWS
    records: list[dict[str, Any]] = field(default_factory=list)
    changed: dict[str, Path] = field(default_factory=dict)
    share: RankShare | None = None

    def __call__(self, layer_pass: LayerPass) -> None:
        layer, prefix = layer_pass.layer, layer_pass.path
        found = [(feeder, group) for feeder, group in MAPPINGS
                 if _find(layer, feeder) is not None and all(isinstance(_find(layer, name), nn.Linear)
                                                             for name in group)]
        wanted = []
        for feeder, group in found:
            record = {"layer": layer_pass.index, "feeder": f"{prefix}.{feeder}",
                      "group": [f"{prefix}.{name}" for name in group]}
            self.records.append(record)
            if not all(path in self.eligible for path in record["group"]):
                record["result"] = "skipped: a Linear of the group is not converted"
            else:
                wanted.append((feeder, group, record))
        if not wanted:
            return
        samples = self._inputs(layer_pass, [group[0] for _, group, _ in wanted])
        if self.share is not None:
            samples = self.share.rows(samples)
        changed: dict[str, torch.Tensor] = {}
        output = None  # the layer's output on step 0 as its weights stand (computed once a fold needs it)
        with torch.no_grad():
            for feeder, group, record in wanted:
                output = self._smooth(layer_pass, feeder, group, samples[group[0]], record, changed, output)
        if changed:
            self.directory.mkdir(parents=True, exist_ok=True)
            file = _layer_file(self.directory, layer_pass.index)
            save_file({f"{prefix}.{name}": tensor.contiguous() for name, tensor in changed.items()}, str(file))
            self.changed.update(dict.fromkeys((f"{prefix}.{name}" for name in changed), file))

    def _inputs(self, layer_pass: LayerPass, names: list[str]) -> dict[str, torch.Tensor]:
        """A seeded sample of each named Linear's input rows over the layer's calibration steps (fp32)."""
        steps = layer_pass.steps or list(range(len(layer_pass.inputs)))
        per_step = math.ceil(self.rows / max(layer_pass.total_steps or len(steps), 1))
        taken: dict[str, list[torch.Tensor]] = {name: [] for name in names}
        current = [0]  # the job's number of the step being run

        def hook(name: str):
            def take(_module: nn.Module, args: tuple[Any, ...]) -> None:  # once per step: rows drawn for this call
                x = args[0].detach().reshape(-1, args[0].shape[-1])
                generator = torch.Generator().manual_seed(layer_pass.index * _SEED_STRIDE + current[0])
                taken[name].append(x[torch.randperm(x.shape[0], generator=generator)[:per_step]].float())
            return take

        handles = [layer_pass.layer.get_submodule(name).register_forward_pre_hook(hook(name)) for name in names]
        try:
            with torch.no_grad():
                for local, step in enumerate(steps):
                    current[0] = step
                    layer_pass.call(layer_pass.layer, local)
        finally:
            for handle in handles:
                handle.remove()
        return {name: torch.cat(rows) for name, rows in taken.items()}

    def _smooth(self, layer_pass: LayerPass, feeder: str, group: tuple[str, ...], x: torch.Tensor,
                record: dict[str, Any], changed: dict[str, torch.Tensor], before: torch.Tensor | None
                ) -> torch.Tensor | None:
        """One mapping: search, fold, check the layer's output, keep or undo; the record says which and why.
        ``before``: the layer's output on step 0 as it stands (None: not computed yet); returns it as it stands
        after."""
        layer = layer_pass.layer
        feeder_module = layer.get_submodule(feeder)
        linears = [layer.get_submodule(name) for name in group]
        if feeder_module.weight.shape[0] != x.shape[1]:
            record["result"] = (f"skipped: {feeder} gives {feeder_module.weight.shape[0]} channels and the group "
                                f"takes {x.shape[1]} (grouped-query attention)")
            return before
        if feeder_module.weight.dim() == 1 and not _scales_outputs(feeder_module):
            record["result"] = (f"skipped: {type(feeder_module).__name__} does not scale its output by its weight "
                                "(e.g. Gemma's 1 + weight), so no scale folds into it")
            return before
        choice = search_smoothing([linear.weight.data.to(self.dtype) for linear in linears], x, steps=self.steps,
                                  share=self.share.search if self.share is not None else None)
        if self.share is not None and not self.share.leader:
            # rank 0 folds and writes; this rank's later searches still match its: each group's search reads only
            # the group's own weights, which no earlier mapping of MAPPINGS changes (a fold changes its feeder)
            return before
        record.update(error=choice.plain_error, smoothed_error=choice.error,
                      relative_error=round(choice.relative_error, 4))
        if choice.scales is None:
            record["result"] = "kept: no ratio lowers the W4A4 output error"
            return before
        if before is None:
            before = layer_pass.call(layer, 0)
        originals = {name: module.weight.data for name, module in [(feeder, feeder_module),
                                                                 *zip(group, linears, strict=True)]}
        bias = getattr(feeder_module, "bias", None)
        original_bias = bias.data if bias is not None else None
        feeder_weight, folded = fold_scales(feeder_module.weight.data, [linear.weight.data for linear in linears],
                                            choice.scales)
        feeder_module.weight.data = self._rounded(feeder_weight)
        if bias is not None:
            bias.data = self._rounded((bias.data.float() / choice.scales).to(bias.dtype))
        for linear, weight in zip(linears, folded, strict=True):
            linear.weight.data = self._rounded(weight)
        after = layer_pass.call(layer, 0)
        moved = float((after.float() - before.float()).norm() / before.float().norm().clamp(min=1e-30))
        if not math.isfinite(moved) or moved > FOLD_TOLERANCE:
            for name, weight in originals.items():
                layer.get_submodule(name).weight.data = weight
            if bias is not None:
                bias.data = original_bias
            record["result"] = (f"skipped: folding moved the layer's output by {moved:.2%} (more than "
                                f"{FOLD_TOLERANCE:.0%}): this layer does not compute what the fold assumes")
            return before
        record.update(result="smoothed", ratio=choice.ratio, output_change=round(moved, 6),
                      scale_range=[round(float(choice.scales.min()), 4), round(float(choice.scales.max()), 4)])
        for name in (feeder, *group):
            changed[f"{name}.weight"] = layer.get_submodule(name).weight.data.to(self.dtype, copy=True)
        if bias is not None:
            changed[f"{feeder}.bias"] = bias.data.to(self.dtype, copy=True)
        return after

    def _rounded(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` rounded to the checkpoint's dtype, kept in its own (what the smoothed checkpoint will hold)."""
        return tensor.to(self.dtype).to(tensor.dtype)


def _find(module: nn.Module, name: str) -> nn.Module | None:
    """The submodule ``name`` of ``module``, or None where it has none."""
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def _scales_outputs(norm: nn.Module) -> bool:
    """Whether ``norm``'s output is its weight times something that does not depend on the weight: a copy in fp32
    with the weight halved must give half the output (a Gemma-style ``1 + weight`` does not)."""
    probe = copy.deepcopy(norm).float()
    x = torch.randn(4, norm.weight.shape[0], generator=torch.Generator().manual_seed(0)).to(norm.weight.device)
    with torch.no_grad():
        full = probe(x)
        probe.weight.data = probe.weight.data / 2
        if getattr(probe, "bias", None) is not None:
            probe.bias.data = probe.bias.data / 2
        half = probe(x)
    return bool(torch.allclose(half * 2, full, rtol=1e-4, atol=1e-6))
