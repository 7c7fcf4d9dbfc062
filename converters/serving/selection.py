"""What a serving format quantizes: which Linears and expert GEMMs get its weights and scales, and why the others
stay in high precision (:class:`ServingSelection`, decided by :func:`select_serving` before calibration; the
export's scales, KV-cache tensors, figures and load audit are added to it as the export proceeds, and its
:meth:`~ServingSelection.report` is the format's block of the job report). Not the precision plan
(:mod:`converters.plan`), which chooses a precision per layer across formats: a selection is one format's.

Which Linears are quantized (:func:`select_serving`): the report's eligible layers, minus layers whose
weight the checkpoint does not store under one plain name, minus every member of a fused group (q/k/v,
gate/up) that is not eligible as a whole: engines fuse those projections and refuse a partly quantized
group. One shared ``input_scale`` per fused group (their input is the same tensor; the group's max,
:func:`set_input_amax`).

Mixture-of-experts: the checkpoint stores each expert's matrices separately (Mixtral ``experts.<e>.w1/w3/w2``,
Qwen/DeepSeek ``experts.<e>.gate_proj/up_proj/down_proj``) and transformers fuses them into 3-D parameters
on load. :func:`expert_disk_keys` reads that fusion back from the checkpoint's own conversion mapping, so
each on-disk matrix is quantized as a weight of its own, under its own name: the gate and up matrices
belong to unit ``<experts>.<e>.gate_up_proj`` (and share its input scale, as vLLM requires of w1 and w3),
the down matrix to ``<experts>.<e>.down_proj``. An experts module is quantized whole or not at all (an
engine runs it as one fused MoE layer of one scheme); an expert that received no calibration token gets
the largest input amax of the other experts of its GEMM (vLLM takes the max over experts anyway).

How the selected weights are written: :mod:`converters.serving.writer`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from converters.analysis.reasons import Reason
from converters.model.experts import EXPERT_GEMMS, parse_unit_path, unit_path
from converters.model.safetensors_stream import SourceTensor
from converters.serving.loads_in import loads_in, loads_in_warnings

__all__ = [
    "ServingFormat",
    "ServingSelection",
    "expert_disk_keys",
    "select_serving",
    "set_input_amax",
]


class ServingFormat(Protocol):
    """One serving checkpoint layout (see :mod:`converters.serving`).

    Optional members, read with ``getattr``: ``needs_weight_amax`` (bool, default False: ``quantize`` then
    gets the keyword ``weight_amax``, the largest ``|w|`` of the weight's fused group or expert unit) and
    ``side_files(selection) -> {file name: JSON value}`` (files written beside config.json).
    """

    name: str
    needs_calibration: bool

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        """The reason code that keeps a Linear of this shape in high precision in this format, or None."""

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        """The tensors replacing ``weight_key`` (itself, or its packed form, first), as plan entries
        (:func:`~converters.model.safetensors_stream.planned_entry`)."""

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype
                 ) -> list[torch.Tensor]:
        """The tensors of :meth:`planned_tensors`, in the same order."""

    def quantization_config(self, selection: ServingSelection) -> dict[str, Any]:
        """The ``quantization_config`` block of config.json."""


@dataclass
class ServingSelection:
    """Which Linears and expert GEMMs a serving format quantizes, and why the others stay in high precision; the
    export's scales, KV-cache tensors, figures and load audit are recorded on it as the export proceeds."""

    format: str
    static_inputs: bool = False  #: the format stores static input scales (it needs calibrated input amax)
    quantized: dict[str, str] = field(default_factory=dict)  #: Linear module path -> on-disk weight key
    experts: dict[str, str] = field(default_factory=dict)  #: on-disk expert matrix key -> its unit path
    input_amax: dict[str, float] = field(default_factory=dict)  #: module path or unit -> calibrated input amax
    input_amax_fallback: dict[str, float] = field(default_factory=dict)  #: unit without tokens -> amax it was given
    skipped: dict[str, str] = field(default_factory=dict)  #: module path or unit -> reason
    linear_paths: list[str] = field(default_factory=list)  #: every Linear of the model, in module order
    router_gates: list[str] = field(default_factory=list)  #: on-disk module names of MoE routers (never quantized)
    #: experts module path -> the on-disk prefix of its per-expert tensors, for experts kept in high precision
    unquantized_experts: dict[str, str] = field(default_factory=dict)
    #: tensors the format adds that replace no source tensor (KV-cache scales): name -> (the source tensor it is
    #: written right after, in that tensor's file; the tensor)
    extra_tensors: dict[str, tuple[str, torch.Tensor]] = field(default_factory=dict)
    kv_cache: str | None = None  #: "fp8" when the export carries KV-cache scales (in ``extra_tensors``)
    #: the quantized members of each fused group (q/k/v, gate/up): they share input and weight-amax scales
    fused_groups: list[list[str]] = field(default_factory=list)
    #: module path or expert unit -> the largest |w| of its fused group or unit (formats with needs_weight_amax)
    weight_amax: dict[str, float] = field(default_factory=dict)
    #: quantized Linear path (or expert matrix name) -> its weight SQNR under this format, from the writer
    layer_stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    kv_cache_report: dict[str, Any] | None = None  #: per attention layer: k/v amax and the scales written
    load_audit: dict[str, Any] | None = None  #: the load audit of the written export (converters.serving.audit)
    #: on-disk weight key -> the file (in the run's rounded-weights directory) holding the tensors calibration already
    #: quantized it to (GPTQ rounding: converters.calibration.gptq_rounding); the writer copies them
    rounded: dict[str, str] = field(default_factory=dict)

    @property
    def expert_units(self) -> list[str]:
        """The quantized expert GEMM units, sorted."""
        return sorted(set(self.experts.values()))

    def report(self) -> dict[str, Any]:
        return {"format": self.format, "quantized": sorted([*self.quantized, *self.expert_units]),
                "skipped": dict(sorted(self.skipped.items())),
                "input_amax": {path: self.input_amax[path] for path in sorted(self.input_amax)},
                "input_amax_fallback": dict(sorted(self.input_amax_fallback.items())),
                "layer_stats": dict(sorted(self.layer_stats.items())), "kv_cache": self.kv_cache_report,
                "load_audit": self.load_audit, "loads_in": [cell.to_dict() for cell in loads_in(self.format)],
                "warnings": loads_in_warnings(self.format)}


def select_serving(fmt: ServingFormat, report: Mapping[str, Any], on_disk_name: Callable[[str], str | None],
                   expert_keys: Mapping[str, tuple[str, ...]] | None = None) -> ServingSelection:
    """Decide what ``fmt`` quantizes from the analysis report and the checkpoint's names (before calibration).

    ``expert_keys`` maps each expert unit to its on-disk matrices (:func:`expert_disk_keys`); experts
    without an entry stay in high precision.
    """
    selection = ServingSelection(format=fmt.name, static_inputs=fmt.needs_calibration,
                                 linear_paths=[layer["path"] for layer in report["layers"]
                                               if layer["class"] != "Conv1D" and "expert" not in layer])
    candidates = {}
    for layer in report["layers"]:
        path = layer["path"]
        if "expert" in layer:
            continue
        if not layer["eligible"]:
            selection.skipped[path] = ",".join(layer["reasons"]) or "not_eligible"
            continue
        rule = fmt.layer_rule(layer["in_features"], layer["out_features"])
        if rule is not None:
            selection.skipped[path] = rule
            continue
        weight_key = on_disk_name(f"{path}.weight")
        if weight_key is None:
            selection.skipped[path] = "weight_not_stored_under_one_name"
            continue
        candidates[path] = weight_key
    for group in report["fused_groups"]:
        if any(member not in candidates for member in group["members"]):
            for member in group["members"]:
                if member in candidates:
                    del candidates[member]
                    selection.skipped[member] = Reason.FUSED_GROUP_PARTIAL.at(group["name"])
    selection.quantized = candidates
    selection.fused_groups = [list(group["members"]) for group in report["fused_groups"]
                         if all(member in candidates for member in group["members"])]
    _select_experts(selection, fmt, report, expert_keys or {})
    selection.router_gates = _router_gates(report, on_disk_name)
    return selection


def _select_experts(selection: ServingSelection, fmt: ServingFormat, report: Mapping[str, Any],
                    expert_keys: Mapping[str, tuple[str, ...]]) -> None:
    """Each experts module whole: every unit quantizable, or all of them skipped with the first failure named."""
    units = {layer["path"]: layer for layer in report["layers"] if "expert" in layer}
    for block in report.get("moe", []):
        module = block["module"]
        paths = [unit_path(module, e, gemm) for gemm in EXPERT_GEMMS for e in range(block["experts"])]
        reasons = {path: _expert_reason(fmt, units[path], expert_keys.get(path)) for path in paths}
        failed = next((path for path in paths if reasons[path] is not None), None)
        if failed is None:
            selection.experts.update({key: path for path in paths for key in expert_keys[path]})
            continue
        group = f"{module}.{parse_unit_path(failed).gemm}"
        for path in paths:
            selection.skipped[path] = reasons[path] or Reason.FUSED_GROUP_PARTIAL.at(group)
        selection.unquantized_experts[module] = _disk_prefix(expert_keys.get(paths[0]), module)


def _expert_reason(fmt: ServingFormat, unit: Mapping[str, Any], keys: tuple[str, ...] | None) -> str | None:
    if not unit["eligible"]:
        return ",".join(unit["reasons"]) or "not_eligible"
    if not keys:
        return "experts_not_stored_per_expert"
    # The format's shape rule applies to each stored matrix: gate and up are [I, H] each, not [2I, H].
    return fmt.layer_rule(unit["in_features"], unit["out_features"] // len(keys))


def _disk_prefix(keys: tuple[str, ...] | None, module: str) -> str:
    """``model.layers.1.block_sparse_moe.experts`` from ``...experts.0.w1.weight``; the module path otherwise."""
    if not keys:
        return module
    prefix, _, index = keys[0].removesuffix(".weight").rpartition(".")[0].rpartition(".")
    return prefix if index.isdigit() else module


def _router_gates(report: Mapping[str, Any], on_disk_name: Callable[[str], str | None]) -> list[str]:
    """On-disk module names of the MoE routers that are not Linears (engines build them as Linears)."""
    gates = []
    for entry in report.get("other_weights", []):
        if entry["reason"] == Reason.ROUTER_WEIGHT and entry["path"].endswith(".weight"):
            key = on_disk_name(entry["path"]) or entry["path"]
            gates.append(key.removesuffix(".weight"))
    return gates


def expert_disk_keys(mapping: list[Any], target_of: Mapping[str, str], report: Mapping[str, Any]
                     ) -> dict[str, tuple[str, ...]]:
    """Each expert unit's on-disk weight keys, in the order of the rows of its GEMM.

    Read from the checkpoint's own conversion mapping (``Checkpoint.mapping``, ``Checkpoint.target_of``),
    as transformers' loader applies it: a WeightConverter stacks the keys of each source pattern over the
    experts in natural key order (``MergeModulelist``) and, for gate_up, concatenates the patterns in their
    listed order (``Concatenate(dim=1)``: gate rows, then up rows). An experts module whose tensors are not
    fused by exactly those operations (stored fused, or another layout) gets no entry.
    """
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    blocks = {block["module"]: block["experts"] for block in report.get("moe", [])}
    by_target: dict[str, dict[str, list[str]]] = {}
    for key, target in target_of.items():
        module, _, gemm = target.rpartition(".")
        if module not in blocks or gemm not in EXPERT_GEMMS:
            continue
        _, pattern = rename_source_key(key, renamings, converters)
        by_target.setdefault(target, {}).setdefault(pattern, []).append(key)
    converter_of = {pattern: entry for entry in converters for pattern in entry.source_patterns}
    keys: dict[str, tuple[str, ...]] = {}
    for target, by_pattern in by_target.items():
        module, _, gemm = target.rpartition(".")
        converter = converter_of.get(next(iter(by_pattern)))
        if converter is None or set(converter.source_patterns) != set(by_pattern) \
                or not _stacks_experts(converter, gemm):
            continue
        ordered = [sorted(by_pattern[pattern], key=dot_natural_key) for pattern in converter.source_patterns]
        if any(len(pattern_keys) != blocks[module] for pattern_keys in ordered):
            continue
        for e in range(blocks[module]):
            keys[unit_path(module, e, gemm)] = tuple(pattern_keys[e] for pattern_keys in ordered)
    return keys


def _stacks_experts(converter: Any, gemm: str) -> bool:
    """Whether ``converter`` stacks per-expert 2-D matrices (and concatenates gate|up on their rows)."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    operations = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
    if gemm == "gate_up_proj":
        return len(converter.source_patterns) == 2 and operations == [(MergeModulelist, 0), (Concatenate, 1)]
    return len(converter.source_patterns) == 1 and operations == [(MergeModulelist, 0)]


def set_input_amax(selection: ServingSelection, report: Mapping[str, Any], amax: Mapping[str, Any]) -> list[str]:
    """Each quantized Linear's and expert GEMM's input amax over all calibration steps.

    One shared value per fused group of Linears. An expert GEMM that saw no token (amax 0) gets, in a
    format with static input scales, the largest input amax of the same GEMM of its module's other
    experts: its scale would otherwise be the dtype's eps, and vLLM takes the max over experts anyway.
    Returns the units that got that fallback.
    """
    paths = [*selection.quantized, *selection.expert_units]
    selection.input_amax = {path: float(amax[path].forward[:, 0].max()) for path in paths}
    for group in report["fused_groups"]:
        members = [member for member in group["members"] if member in selection.quantized]
        if members:
            shared = max(selection.input_amax[member] for member in members)
            selection.input_amax.update({member: shared for member in members})
    selection.input_amax_fallback = {}
    if not selection.static_inputs:
        return []
    groups: dict[str, list[str]] = {}
    for unit in selection.expert_units:
        parsed = parse_unit_path(unit)
        groups.setdefault(f"{parsed.module}.{parsed.gemm}", []).append(unit)
    for units in groups.values():
        fallback = max(selection.input_amax[unit] for unit in units)
        for unit in units:
            if selection.input_amax[unit] == 0:
                selection.input_amax[unit] = selection.input_amax_fallback[unit] = fallback
    return sorted(selection.input_amax_fallback)
