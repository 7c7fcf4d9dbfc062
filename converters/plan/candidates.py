"""The precisions a plan chooses among on a GPU, and what each costs a layer: weight bytes, GEMM FLOPs, shape rule.

The candidates are bf16 and the stateless TE recipes (delayed scaling has state a per-layer mix cannot seed, and
Megatron's per-module precision config refuses it too): FP8 per-tensor current scaling, MXFP8, block FP8 128x128
and NVFP4. Which GPU runs which is the recipes' own hardware rule (``converters.recipes.requirements``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from converters.analysis.reasons import Reason
from converters.plan.settings import GPUS
from converters.recipes.presets import RECIPE_NAMES
from converters.recipes.registry import recipe_from_dict

__all__ = ["plan_compare_recipes", "BF16", "PRECISIONS", "ASSUMED_CUDA", "Unit", "precisions_for", "recipe_of",
           "weight_bytes",
           "decision_units", "low_precision"]

BF16 = "bf16"
#: plan precision -> the recipe short name (converters.recipes.presets) whose casts it is
PRECISIONS: dict[str, str] = {"fp8-current": "te-current", "fp8-block": "te-float8-block", "mxfp8": "te-mxfp8",
                              "nvfp4": "te-nvfp4"}
#: CUDA of the torch build a plan assumes (block FP8 needs 12.9+)
ASSUMED_CUDA = "12.9"


def recipe_of(precision: str) -> Any:
    """The recipe object of a plan precision (at its defaults)."""
    return recipe_from_dict(RECIPE_NAMES[PRECISIONS[precision]])


def precisions_for(gpu: str) -> tuple[list[str], dict[str, str]]:
    """The precisions ``gpu`` runs (after bf16), and why each other one is out."""
    capability = GPUS[gpu]
    runs, out = [], {}
    for precision in PRECISIONS:
        why = recipe_of(precision).hardware().unmet(capability, ASSUMED_CUDA)
        if why is None:
            runs.append(precision)
        else:
            out[precision] = why
    return runs, out


def low_precision(precision: str) -> bool:
    return precision != BF16


def weight_bytes(precision: str, out_features: int, in_features: int) -> int:
    """Bytes of a Linear's weight and its scales as the format stores them.

    bf16: 2 per element. FP8 current scaling: 1 per element and one fp32 scale. Block FP8: one fp32 scale per
    128x128 block. MXFP8: one E8M0 byte per 32 elements. NVFP4: half a byte per element, one E4M3 byte per 16
    and one fp32 global scale.
    """
    n = out_features * in_features
    if precision == BF16:
        return 2 * n
    if precision == "fp8-current":
        return n + 4
    if precision == "fp8-block":
        return n + 4 * math.ceil(out_features / 128) * math.ceil(in_features / 128)
    if precision == "mxfp8":
        return n + math.ceil(n / 32)
    if precision == "nvfp4":
        return math.ceil(n / 2) + math.ceil(n / 16) + 4
    raise ValueError(f"unknown precision {precision!r}")


@dataclass(frozen=True)
class Unit:
    """What a plan decides at once: one Linear, or a fused group (q/k/v, gate/up) that engines and Megatron run as
    one GEMM and so must share a precision."""

    name: str
    members: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...]  #: (out_features, in_features) per member

    def fits(self, precision: str) -> bool:
        """Every member meets the precision's shape rule."""
        if precision == BF16:
            return True
        rule = recipe_of(precision).shape_rule()
        return not any(rule.fails(inp, out) for out, inp in self.shapes)

    def excluded(self, precision: str) -> dict[str, str]:
        """Member -> why ``precision`` cannot hold it: the shape rule's reason code (the analysis's) for a member that
        breaks the rule, ``Reason.FUSED_GROUP_PARTIAL`` with the unit for the others of a group one member breaks."""
        if self.fits(precision):
            return {}
        rule = recipe_of(precision).shape_rule()
        return {member: rule.reason if rule.fails(inp, out) else Reason.FUSED_GROUP_PARTIAL.at(self.name)
                for member, (out, inp) in zip(self.members, self.shapes, strict=True)}

    def bytes(self, precision: str) -> int:
        return sum(weight_bytes(precision, out, inp) for out, inp in self.shapes)

    @property
    def flops_per_token(self) -> int:
        return sum(2 * out * inp for out, inp in self.shapes)


def decision_units(report: dict[str, Any]) -> tuple[list[Unit], dict[str, str]]:
    """The units a plan decides, from an analysis report; and the Linears it leaves in bf16, with the reason.

    A Linear the analysis calls ineligible (first/last, router, excluded, shape) stays bf16. A fused group is one
    unit when all its members are eligible; a partly eligible group stays bf16 whole.
    """
    layers = {layer["path"]: layer for layer in report["layers"] if "expert" not in layer}
    kept = {path: "not eligible: " + ", ".join(layer["reasons"]) for path, layer in layers.items()
            if not layer["eligible"]}
    grouped: set[str] = set()
    units = []
    for group in report["fused_groups"]:
        members = [m for m in group["members"] if m in layers]
        if not members:
            continue
        grouped.update(members)
        if all(layers[m]["eligible"] for m in members):
            units.append(Unit(group["name"], tuple(members),
                              tuple((layers[m]["out_features"], layers[m]["in_features"]) for m in members)))
        else:
            for m in members:
                kept.setdefault(m, f"fused group {group['name']} is only partly eligible: one GEMM, kept bf16 whole")
    for path, layer in layers.items():
        if path not in grouped and layer["eligible"]:
            units.append(Unit(path, (path,), ((layer["out_features"], layer["in_features"]),)))
    order = {path: index for index, path in enumerate(layers)}
    units.sort(key=lambda unit: order[unit.members[0]])
    return units, kept


def plan_compare_recipes(plan: Mapping[str, Any] | None, compare: Sequence[Any] = ()) -> tuple[Any, ...]:
    """``compare`` and, for a request with a ``plan``, the recipe names of the precisions its GPU runs: the
    calibration's SQNR meter measures them, and the plan reads each layer's SQNR from the comparison."""
    if plan is None:
        return tuple(compare)
    runs, _ = precisions_for(plan["gpu"])
    return (*compare, *(PRECISIONS[p] for p in runs if PRECISIONS[p] not in compare))
