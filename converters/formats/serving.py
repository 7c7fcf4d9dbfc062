"""Serving exports: FP8 weights (and static input scales) from the job's own calibration, streamed shard by shard.

An inference engine loads a serving checkpoint as a whole directory: the source's weight files with the
quantized Linears' ``weight`` replaced by FP8 and their scales added beside it, under the checkpoint's own
tensor names, plus ``config.json`` with the format's ``quantization_config``. Every other tensor is copied
as bytes (:mod:`converters.safetensors_stream`), and only one weight is ever decoded at a time, so the
export's memory is that of the largest weight, whatever the model's size.

Which Linears are quantized (:func:`plan_serving`): the report's eligible layers, minus layers whose
weight the checkpoint does not store under one plain name, minus every member of a fused group (q/k/v,
gate/up) that is not eligible as a whole: engines fuse those projections and refuse a partly quantized
group. One shared ``input_scale`` per fused group (their input is the same tensor; the group's max).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from converters.artifact_io import INDEX_NAME, copy_side_files, write_json
from converters.safetensors_stream import SourceTensor, StreamingWriter, read_tensor, read_tensor_index

__all__ = [
    "FP8_E4M3_MAX",
    "ServingFormat",
    "ServingPlan",
    "plan_serving",
    "set_input_amax",
    "write_serving_checkpoint",
]

FP8_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


class ServingFormat(Protocol):
    """One serving checkpoint layout (see :mod:`converters.formats`)."""

    name: str
    needs_calibration: bool

    def layer_rule(self, in_features: int, out_features: int) -> str | None:
        """The reason code that keeps a Linear of this shape in high precision in this format, or None."""

    def planned_tensors(self, weight_key: str, weight: SourceTensor, scale_dtype: torch.dtype) -> dict[str, Any]:
        """The tensors replacing ``weight_key`` (itself first), as StreamingWriter plan entries."""

    def quantize(self, weight: torch.Tensor, input_amax: float | None, scale_dtype: torch.dtype
                 ) -> list[torch.Tensor]:
        """The tensors of :meth:`planned_tensors`, in the same order."""

    def quantization_config(self, plan: ServingPlan) -> dict[str, Any]:
        """The ``quantization_config`` block of config.json."""


@dataclass
class ServingPlan:
    """Which Linears a serving format quantizes, and why the others stay in high precision."""

    format: str
    quantized: dict[str, str] = field(default_factory=dict)  #: module path -> on-disk weight key
    input_amax: dict[str, float] = field(default_factory=dict)  #: module path -> calibrated input amax
    skipped: dict[str, str] = field(default_factory=dict)  #: module path -> reason
    linear_paths: list[str] = field(default_factory=list)  #: every Linear of the model, in module order

    def report(self) -> dict[str, Any]:
        return {"format": self.format, "quantized": sorted(self.quantized),
                "skipped": dict(sorted(self.skipped.items())),
                "input_amax": {path: self.input_amax[path] for path in sorted(self.input_amax)}}


def plan_serving(fmt: ServingFormat, report: Mapping[str, Any], on_disk_name: Callable[[str], str | None]
                 ) -> ServingPlan:
    """Decide what ``fmt`` quantizes from the analysis report and the checkpoint's names (before calibration)."""
    plan = ServingPlan(format=fmt.name, linear_paths=[layer["path"] for layer in report["layers"]
                                                      if layer["class"] != "Conv1D" and "expert" not in layer])
    candidates = {}
    for layer in report["layers"]:
        path = layer["path"]
        if "expert" in layer:
            plan.skipped[path] = "expert_gemm_not_in_serving_export"
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
                    plan.skipped[member] = f"fused_group_not_fully_eligible:{group['name']}"
    plan.quantized = candidates
    return plan


def set_input_amax(plan: ServingPlan, report: Mapping[str, Any], amax: Mapping[str, Any]) -> None:
    """Each quantized Linear's input amax over all calibration steps; one shared value per fused group."""
    plan.input_amax = {path: float(amax[path].forward[:, 0].max()) for path in plan.quantized}
    for group in report["fused_groups"]:
        members = [member for member in group["members"] if member in plan.quantized]
        if members:
            shared = max(plan.input_amax[member] for member in members)
            plan.input_amax.update({member: shared for member in members})


def write_serving_checkpoint(fmt: ServingFormat, plan: ServingPlan, source_dir: Path, weight_files: list[Path],
                             directory: Path, scale_dtype: torch.dtype,
                             check_stop: Callable[[], None] | None = None) -> list[str]:
    """Write ``fmt``'s checkpoint of the source into ``directory``: weight files, index, config, side files.

    Returns the file names written (relative to ``directory``).
    """
    directory.mkdir(parents=True, exist_ok=True)
    path_of = {key: path for path, key in plan.quantized.items()}
    weight_map: dict[str, str] = {}
    total = 0
    for source in weight_files:
        tensors, metadata = read_tensor_index(source)
        entries: dict[str, Any] = {}
        for name, tensor in tensors.items():
            entries.update(fmt.planned_tensors(name, tensor, scale_dtype) if name in path_of else {name: tensor})
        with StreamingWriter(directory / source.name, entries, metadata) as writer:
            for name, tensor in tensors.items():
                if check_stop is not None:
                    check_stop()
                if name not in path_of:
                    writer.write(name, tensor)
                    continue
                # Read with pread, not a mapped file: the pages of a whole shard would otherwise stay resident.
                replacement = fmt.quantize(read_tensor(tensor), plan.input_amax.get(path_of[name]), scale_dtype)
                for key, value in zip(fmt.planned_tensors(name, tensor, scale_dtype), replacement, strict=True):
                    writer.write(key, value)
        weight_map.update({name: source.name for name in entries})
        total += sum(writer.planned[name].nbytes for name in entries)
    written = [source.name for source in weight_files]
    if (source_dir / INDEX_NAME).is_file():
        write_json(directory / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        written.append(INDEX_NAME)
    config = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
    config["quantization_config"] = fmt.quantization_config(plan)
    write_json(directory / "config.json", config)
    written.append("config.json")
    return written + copy_side_files(source_dir, directory)
