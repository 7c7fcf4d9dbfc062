"""Mixture-of-experts blocks as FP8 units: which experts modules there are, and how each expert GEMM is named.

In transformers 5 the experts of Mixtral, Qwen2/Qwen3-MoE, DeepSeek-V3 and their relatives are one module
holding fused 3-D parameters (``@use_experts_implementation``): ``gate_up_proj [E, 2I, H]`` (the gate rows
first, then the up rows) and ``down_proj [E, H, I]``, each ``[out, in]`` per expert, as ``nn.Linear`` stores
its weight. Every expert runs two GEMMs, so each experts module ``P`` holds ``2E`` units, named like Linear
paths so that include/exclude patterns and reports treat them alike:

    P.<e>.gate_up_proj   in = H, out = 2I
    P.<e>.down_proj      in = I, out = H

Layouts that store the weights transposed ``[E, in, out]`` with biases (gpt-oss) or run every expert on every
token (Llama 4) are listed with the reason ``expert_layout_unsupported`` rather than converted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

__all__ = [
    "EXPERT_GEMMS",
    "ExpertUnit",
    "ExpertsModule",
    "find_experts",
    "parse_unit_path",
    "unit_path",
]

EXPERT_GEMMS = ("gate_up_proj", "down_proj")
_UNIT = re.compile(r"^(?P<module>.+)\.(?P<index>\d+)\.(?P<gemm>gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class ExpertsModule:
    """One fused experts module of a model."""

    path: str  #: e.g. ``model.layers.3.mlp.experts``
    cls: str
    num_experts: int
    hidden: int  #: H
    intermediate: int  #: I
    supported: bool
    why_not: str = ""  #: why an unsupported layout is not converted

    def features(self, gemm: str) -> tuple[int, int]:
        """``(in_features, out_features)`` of one expert's GEMM."""
        if gemm == "gate_up_proj":
            return self.hidden, 2 * self.intermediate
        return self.intermediate, self.hidden

    def units(self) -> list[str]:
        """Every unit path, expert by expert (gate_up then down), as the report lists them."""
        return [unit_path(self.path, e, gemm) for e in range(self.num_experts) for gemm in EXPERT_GEMMS]


@dataclass(frozen=True)
class ExpertUnit:
    module: str  #: the experts module's path
    index: int
    gemm: str


def unit_path(module_path: str, index: int, gemm: str) -> str:
    return f"{module_path}.{index}.{gemm}"


def parse_unit_path(path: str) -> ExpertUnit | None:
    """The unit a path names, or None for any other path (a Linear, a parameter)."""
    match = _UNIT.match(path)
    if match is None:
        return None
    return ExpertUnit(match["module"], int(match["index"]), match["gemm"])


def find_experts(named: Iterable[tuple[str, nn.Module]]) -> list[ExpertsModule]:
    """Every fused experts module among ``named`` (``model.named_modules()``), in model order."""
    found = []
    for path, module in named:
        gate_up = module._parameters.get("gate_up_proj")
        down = module._parameters.get("down_proj")
        if gate_up is None or down is None or gate_up.dim() != 3 or down.dim() != 3:
            continue
        supported, why_not = _layout(module)
        num_experts = int(gate_up.shape[0])
        transposed = getattr(module, "is_transposed", None)
        if transposed is None:  # no kernel switch: tell the layout from the shapes ([E, H, 2I] with [E, I, H])
            transposed = gate_up.shape[1] == down.shape[2] and gate_up.shape[2] == 2 * down.shape[1]
        if transposed:
            hidden, intermediate = int(gate_up.shape[1]), int(gate_up.shape[2]) // 2
        else:
            hidden, intermediate = int(gate_up.shape[2]), int(gate_up.shape[1]) // 2
        found.append(ExpertsModule(path, type(module).__name__, num_experts, hidden, intermediate, supported, why_not))
    return found


def _layout(module: nn.Module) -> tuple[bool, str]:
    """Whether the experts follow the layout fp8forge converts: ``[E, out, in]`` weights, gate|up concatenated."""
    if not hasattr(module, "is_transposed"):
        return False, (f"{type(module).__name__} is not a transformers experts module with switchable kernels "
                       "(it runs every expert on every token or has its own forward)")
    if module.is_transposed or not module.is_concatenated:
        return False, f"{type(module).__name__} stores its expert weights transposed or gate/up interleaved"
    if module.has_bias or not module.has_gate or getattr(module, "has_post_expert_norm", False):
        return False, f"{type(module).__name__} has expert biases, no gate or a post-expert norm"
    return True, ""
