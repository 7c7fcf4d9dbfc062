"""Serving exports: FP8 weights (and static input scales) from the job's own calibration, streamed shard by shard.

An inference engine loads a serving checkpoint as a whole directory: the source's weight files with the
quantized Linears' ``weight`` replaced by FP8 and their scales added beside it, under the checkpoint's own
tensor names, plus ``config.json`` with the format's ``quantization_config``. Every other tensor is copied
as bytes (:mod:`converters.model.safetensors_stream`), and only one weight is ever decoded at a time, so the
export's memory is that of the largest weight, whatever the model's size.

Which Linears are quantized (:func:`plan_serving`): the report's eligible layers, minus layers whose
weight the checkpoint does not store under one plain name, minus every member of a fused group (q/k/v,
gate/up) that is not eligible as a whole: engines fuse those projections and refuse a partly quantized
group. One shared ``input_scale`` per fused group (their input is the same tensor; the group's max).

Formats with a per-tensor weight scale that engines require equal across a fused group (NVFP4's global
scale) set ``needs_weight_amax``: before writing, :func:`set_weight_amax` reads each quantized weight once
(one tensor at a time) and records the group's largest ``|w|``, which ``quantize`` then receives as
``weight_amax``. Formats that need files beside config.json (ModelOpt's ``hf_quant_config.json``) define
``side_files``.

Mixture-of-experts: the checkpoint stores each expert's matrices separately (Mixtral ``experts.<e>.w1/w3/w2``,
Qwen/DeepSeek ``experts.<e>.gate_proj/up_proj/down_proj``) and transformers fuses them into 3-D parameters
on load. :func:`expert_disk_keys` reads that fusion back from the checkpoint's own conversion mapping, so
each on-disk matrix is quantized as a weight of its own, under its own name: the gate and up matrices
belong to unit ``<experts>.<e>.gate_up_proj`` (and share its input scale, as vLLM requires of w1 and w3),
the down matrix to ``<experts>.<e>.down_proj``. An experts module is quantized whole or not at all (an
engine runs it as one fused MoE layer of one scheme); an expert that received no calibration token gets
the largest input amax of the other experts of its GEMM (vLLM takes the max over experts anyway).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from converters.analysis.reasons import Reason
from converters.casts.emulation import max_abs
from converters.model.experts import EXPERT_GEMMS, parse_unit_path, unit_path
from converters.model.files import FileConfinement
from converters.model.finite import check_converted
from converters.model.safetensors_stream import ReadBuffers, SourceTensor, read_tensor, read_tensor_index
from converters.rewrite import Compute, Copy, cast_in_strips, finish_checkpoint, strip_rows
from converters.rewrite import write_shard as rewrite_shard
from converters.serving.loads_in import loads_in, loads_in_warnings
from converters.serving.written_sqnr import written_weight_sqnr

__all__ = [
    "ServingFormat",
    "ServingPlan",
    "expert_disk_keys",
    "layer_stats",
    "plan_serving",
    "quantize_weight",
    "set_input_amax",
    "set_weight_amax",
    "write_serving_checkpoint",
    "write_serving_file",
]



class ServingFormat(Protocol):
    """One serving checkpoint layout (see :mod:`converters.serving`).

    Optional members, read with ``getattr``: ``needs_weight_amax`` (bool, default False: ``quantize`` then
    gets the keyword ``weight_amax``, the largest ``|w|`` of the weight's fused group or expert unit) and
    ``side_files(plan) -> {file name: JSON value}`` (files written beside config.json).
    """

    name: str
    needs_calibration: bool

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        """The reason code that keeps a Linear of this shape in high precision in this format, or None."""

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        """The tensors replacing ``weight_key`` (itself, or its packed form, first), as StreamingWriter plan entries."""

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype
                 ) -> list[torch.Tensor]:
        """The tensors of :meth:`planned_tensors`, in the same order."""

    def quantization_config(self, plan: ServingPlan) -> dict[str, Any]:
        """The ``quantization_config`` block of config.json."""


@dataclass
class ServingPlan:
    """Which Linears and expert GEMMs a serving format quantizes, and why the others stay in high precision."""

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


def plan_serving(fmt: ServingFormat, report: Mapping[str, Any], on_disk_name: Callable[[str], str | None],
                 expert_keys: Mapping[str, tuple[str, ...]] | None = None) -> ServingPlan:
    """Decide what ``fmt`` quantizes from the analysis report and the checkpoint's names (before calibration).

    ``expert_keys`` maps each expert unit to its on-disk matrices (:func:`expert_disk_keys`); experts
    without an entry stay in high precision.
    """
    plan = ServingPlan(format=fmt.name, static_inputs=fmt.needs_calibration,
                       linear_paths=[layer["path"] for layer in report["layers"]
                                     if layer["class"] != "Conv1D" and "expert" not in layer])
    candidates = {}
    for layer in report["layers"]:
        path = layer["path"]
        if "expert" in layer:
            continue
        if not layer["eligible"]:
            plan.skipped[path] = ",".join(layer["reasons"]) or "not_eligible"
            continue
        rule = fmt.layer_rule(layer["in_features"], layer["out_features"])
        if rule is not None:
            plan.skipped[path] = rule
            continue
        weight_key = on_disk_name(f"{path}.weight")
        if weight_key is None:
            plan.skipped[path] = "weight_not_stored_under_one_name"
            continue
        candidates[path] = weight_key
    for group in report["fused_groups"]:
        if any(member not in candidates for member in group["members"]):
            for member in group["members"]:
                if member in candidates:
                    del candidates[member]
                    plan.skipped[member] = Reason.FUSED_GROUP_PARTIAL.at(group["name"])
    plan.quantized = candidates
    plan.fused_groups = [list(group["members"]) for group in report["fused_groups"]
                         if all(member in candidates for member in group["members"])]
    _plan_experts(plan, fmt, report, expert_keys or {})
    plan.router_gates = _router_gates(report, on_disk_name)
    return plan


def _plan_experts(plan: ServingPlan, fmt: ServingFormat, report: Mapping[str, Any],
                  expert_keys: Mapping[str, tuple[str, ...]]) -> None:
    """Each experts module whole: every unit quantizable, or all of them skipped with the first failure named."""
    units = {layer["path"]: layer for layer in report["layers"] if "expert" in layer}
    for block in report.get("moe", []):
        module = block["module"]
        paths = [unit_path(module, e, gemm) for gemm in EXPERT_GEMMS for e in range(block["experts"])]
        reasons = {path: _expert_reason(fmt, units[path], expert_keys.get(path)) for path in paths}
        failed = next((path for path in paths if reasons[path] is not None), None)
        if failed is None:
            plan.experts.update({key: path for path in paths for key in expert_keys[path]})
            continue
        group = f"{module}.{parse_unit_path(failed).gemm}"
        for path in paths:
            plan.skipped[path] = reasons[path] or Reason.FUSED_GROUP_PARTIAL.at(group)
        plan.unquantized_experts[module] = _disk_prefix(expert_keys.get(paths[0]), module)


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


def set_input_amax(plan: ServingPlan, report: Mapping[str, Any], amax: Mapping[str, Any]) -> list[str]:
    """Each quantized Linear's and expert GEMM's input amax over all calibration steps.

    One shared value per fused group of Linears. An expert GEMM that saw no token (amax 0) gets, in a
    format with static input scales, the largest input amax of the same GEMM of its module's other
    experts: its scale would otherwise be the dtype's eps, and vLLM takes the max over experts anyway.
    Returns the units that got that fallback.
    """
    paths = [*plan.quantized, *plan.expert_units]
    plan.input_amax = {path: float(amax[path].forward[:, 0].max()) for path in paths}
    for group in report["fused_groups"]:
        members = [member for member in group["members"] if member in plan.quantized]
        if members:
            shared = max(plan.input_amax[member] for member in members)
            plan.input_amax.update({member: shared for member in members})
    plan.input_amax_fallback = {}
    if not plan.static_inputs:
        return []
    groups: dict[str, list[str]] = {}
    for unit in plan.expert_units:
        parsed = parse_unit_path(unit)
        groups.setdefault(f"{parsed.module}.{parsed.gemm}", []).append(unit)
    for units in groups.values():
        fallback = max(plan.input_amax[unit] for unit in units)
        for unit in units:
            if plan.input_amax[unit] == 0:
                plan.input_amax[unit] = plan.input_amax_fallback[unit] = fallback
    return sorted(plan.input_amax_fallback)


def set_weight_amax(plan: ServingPlan, weight_files: list[Path]) -> None:
    """Each quantized Linear's and expert unit's weight amax, shared by its fused group (a streaming pre-pass).

    Reads one weight at a time (pread, not a mapped file), so memory stays that of the largest weight. The
    amax is exact in float32 (the largest magnitude of the stored values); an expert unit's gate and up
    matrices share one value, as do the members of each fused group.
    """
    path_of = {key: path for path, key in plan.quantized.items()} | plan.experts
    amax: dict[str, float] = {}
    buffers = ReadBuffers(kept=1)  # one weight at a time, each read into the memory of the one before
    for source in weight_files:
        tensors, _ = read_tensor_index(source)
        for name, tensor in tensors.items():
            if name in path_of:
                # exact in the weight's dtype: one pass, without fp32 and |w| copies (+ 0.0: -0.0 reads 0.0)
                value = float(max_abs(read_tensor(tensor, buffers)).float()) + 0.0
                amax[path_of[name]] = max(amax.get(path_of[name], 0.0), value)
    for members in plan.fused_groups:
        shared = max(amax[member] for member in members)
        amax.update({member: shared for member in members})
    plan.weight_amax = amax


def layer_stats(fmt: ServingFormat, weight: torch.Tensor, written: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """One quantized weight's figures for the report: the format's own ``layer_stats(weight, tensors)`` where it
    has one, else the SQNR (dB) of the weight the ``written`` tensors (name -> tensor, in the format's order) hold,
    read from them without a second cast (:mod:`converters.serving.written_sqnr`), else nothing (a format without
    a ``weight_cast``, or a layout that module does not read)."""
    own = getattr(fmt, "layer_stats", None)
    if own is not None:
        return {key: round(value, 3) if isinstance(value, float) else value
                for key, value in own(weight, list(written.values())).items()}
    if getattr(fmt, "weight_cast", None) is None:
        return {}
    value = written_weight_sqnr(weight, written)
    return {"weight_sqnr_db": None if value is None else round(value, 2), "measured_on": "written_tensors"}


def write_serving_checkpoint(fmt: ServingFormat, plan: ServingPlan, source_dir: Path, weight_files: list[Path],
                             directory: Path, scale_dtype: torch.dtype, confinement: FileConfinement,
                             check_stop: Callable[[], None] | None = None, *, emulated_stats: bool = True
                             ) -> list[str]:
    """Write ``fmt``'s checkpoint of the source into ``directory``: weight files, index, config, side files.

    Each quantized weight's figures go into ``plan.layer_stats`` (:func:`layer_stats`); ``emulated_stats`` False
    leaves out the weight SQNR of the written tensors (a pass over each weight's codes) where the caller has the
    figure already, from its calibration's meter, or was asked not to measure; a format's own ``layer_stats`` stays.

    Side files are copied without reading outside ``confinement``.

    Returns the file names written (relative to ``directory``).
    """
    directory.mkdir(parents=True, exist_ok=True)
    if getattr(fmt, "needs_weight_amax", False):
        set_weight_amax(plan, weight_files)
    shards = []
    for source in weight_files:
        shards.append(write_serving_file(fmt, plan, source, directory, scale_dtype, check_stop=check_stop,
                                         emulated_stats=emulated_stats))
        plan.layer_stats.update(shards[-1]["layer_stats"])
    side_files = getattr(fmt, "side_files", None)
    return [source.name for source in weight_files] + finish_checkpoint(
        source_dir, directory, shards, quantization_config=fmt.quantization_config(plan), confinement=confinement,
        json_files=side_files(plan) if side_files is not None else None)


def write_serving_file(fmt: ServingFormat, plan: ServingPlan, source: Path, directory: Path, scale_dtype: torch.dtype,
                       *, check_stop: Callable[[], None] | None = None, emulated_stats: bool = True) -> dict[str, Any]:
    """Write ``source``'s weight file of ``fmt``'s checkpoint into ``directory`` (the weight amax, where the format
    needs it, taken from the plan: it spans every file). One file needs nothing of the others, so a serving export
    may be written a file at a time by any process.

    Returns the file's name, its tensor names, their bytes and each quantized weight's figures
    (:func:`layer_stats`; ``emulated_stats`` as in :func:`write_serving_checkpoint`), as plain data.
    """
    needs_weight_amax = getattr(fmt, "needs_weight_amax", False)
    path_of = {key: path for path, key in plan.quantized.items()} | plan.experts
    added_after: dict[str, dict[str, torch.Tensor]] = {}
    for name, (anchor, value) in plan.extra_tensors.items():
        added_after.setdefault(anchor, {})[name] = value
    tensors, metadata = read_tensor_index(source)
    buffers = ReadBuffers()  # the file's weights read into memory the ones before them no longer use
    steps: list[Copy | Compute] = []
    for name, tensor in tensors.items():
        if name not in path_of:
            steps.append(Copy(name, tensor))
        else:
            # Read with pread, not a mapped file: the pages of a whole shard would otherwise stay resident.
            amax = {"weight_amax": plan.weight_amax[path_of[name]]} if needs_weight_amax else {}
            label = name.removesuffix(".weight") if name in plan.experts else path_of[name]
            stats = emulated_stats or getattr(fmt, "layer_stats", None) is not None
            outputs = fmt.planned_tensors(name, tensor, scale_dtype)
            quantize = functools.partial(quantize_weight, fmt, name, outputs, plan.input_amax.get(path_of[name]),
                                         scale_dtype, amax, label if stats else None)
            steps.append(Compute(outputs=outputs, read=functools.partial(read_tensor, tensor, buffers),
                                 convert=quantize))
        for added, value in added_after.get(name, {}).items():
            steps.append(Compute(outputs={added: value}, read=lambda: None,
                                 convert=lambda _, value=value: ([value], None)))
    directory.mkdir(parents=True, exist_ok=True)
    written = rewrite_shard(directory / source.name, steps, metadata, check_stop=check_stop)
    return {"file": source.name, "tensors": written.tensors, "bytes": written.bytes,
            "layer_stats": dict(note for note in written.notes if note is not None)}


def quantize_weight(fmt: ServingFormat, name: str, outputs: dict[str, Any], input_amax: float | None,
                    scale_dtype: torch.dtype, options: dict[str, float], label: str | None, weight: torch.Tensor, *,
                    check_weight: bool = True) -> tuple[list[torch.Tensor], tuple[str, dict[str, Any]] | None]:
    """``weight`` (``name``) quantized to ``fmt`` as the tensors ``outputs`` plans, in strips of rows where its cast
    allows (:mod:`converters.rewrite.strips`), checked finite; with it a note: its figures under ``label``
    (:func:`layer_stats`; None: no figures). The convert of a rewrite's :class:`~converters.rewrite.Compute` step.

    ``options``: the format's keyword arguments (``weight_amax``). ``check_weight`` False: the weight was checked
    finite where it was read (:func:`~converters.model.finite.check_converted`).

    Raises:
        ModelConfigError: the weight or what it gave holds NaN or an infinity.
    """
    cast = functools.partial(_cast, fmt, input_amax, scale_dtype, options)
    step = strip_rows(fmt, weight)
    replacement = cast(weight) if step is None else cast_in_strips(cast, weight, step, outputs)
    written = dict(zip(outputs, replacement, strict=True))
    check_converted(name, weight, written, fmt.name, check_weight=check_weight)
    if label is None:
        return replacement, None
    return replacement, (label, layer_stats(fmt, weight, written))


def _cast(fmt: ServingFormat, input_amax: float | None, scale_dtype: torch.dtype, options: dict[str, float],
          weight: torch.Tensor) -> list[torch.Tensor]:
    return fmt.quantize(weight, input_amax, scale_dtype, **options)
