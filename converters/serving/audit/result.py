"""What an audit reports: rule codes, one problem per broken rule, and the result of one export."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = ["AuditResult", "Problem", "Rule"]


class Rule(str, Enum):
    """What a problem breaks; each member says what vLLM does with such a checkpoint."""

    SCALE_DROPPED = "scale_dropped"  #: maps to no parameter: load error, or (KV scales) ignored -> scale 1.0
    PARTLY_QUANTIZED_FUSED_GROUP = "partly_quantized_fused_group"  #: quantized and high-precision shards in one layer
    PARTLY_IGNORED_FUSED_GROUP = "partly_ignored_fused_group"  #: ignore list names some shards of a fused layer
    IGNORED_MODULE_MISSING = "ignored_module_missing"  #: an ignore/exclude entry matches no module of the checkpoint
    UNQUANTIZED_NOT_IGNORED = "unquantized_not_ignored"  #: engine builds quantized params for a high-precision weight
    QUANTIZED_BUT_IGNORED = "quantized_but_ignored"  #: engine builds high-precision params for a quantized weight
    MISSING_SCALE = "missing_scale"  #: a quantized weight lacks a scale its scheme needs
    WRONG_SCALE_SHAPE = "wrong_scale_shape"  #: a scale's shape is not the one its scheme creates
    WRONG_SCALE_DTYPE = "wrong_scale_dtype"  #: a scale's dtype is not one its scheme's parameter loads correctly
    #: the shards of one fused layer (or an expert's w1/w3) carry different NVFP4 global scales: vLLM keeps one
    FUSED_GLOBAL_SCALE_DIFFERS = "fused_global_scale_differs"
    CONFIG_REJECTED = "config_rejected"  #: vLLM raises while reading the quantization config


@dataclass(frozen=True, kw_only=True)
class Problem:
    rule: Rule
    name: str  #: checkpoint tensor or module (or vLLM fused layer / parameter) it concerns
    message: str  #: what the engine would do, and how to fix it


@dataclass(kw_only=True)
class AuditResult:
    format: str  #: quant_method (and format or quant_algo) read from the quantization config
    audited: bool  #: False when the format has no rules here (see ``notes``)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    tensors_checked: int = 0
    scales_checked: int = 0
    kv_scales_found: int = 0

    @property
    def ok(self) -> bool:
        """Audited and no problem found."""
        return self.audited and not self.problems

    def rules(self) -> set[Rule]:
        return {problem.rule for problem in self.problems}

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, "audited": self.audited, "ok": self.ok, "notes": self.notes,
                "tensors_checked": self.tensors_checked, "scales_checked": self.scales_checked,
                "kv_scales_found": self.kv_scales_found,
                "problems": [{"rule": p.rule.value, "name": p.name, "message": p.message} for p in self.problems]}
