"""What a precision plan is asked for: a target (end-to-end KL, perplexity increase or per-layer SQNR), an objective
(least memory or most FP8 GEMM FLOPs) and the GPU it is for. Torch-free: the request and the CLI read it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from converters.errors import RequestError

__all__ = ["GPUS", "OBJECTIVES", "TARGETS", "PLAN_KEYS", "PlanSettings"]

#: GPU name -> compute capability; which recipes each runs comes from the recipes' own hardware rules
#: (converters.recipes.requirements), read at this capability with a CUDA 12.9+ build.
GPUS: dict[str, tuple[int, int]] = {
    "a100": (8, 0), "l4": (8, 9), "l40s": (8, 9), "h100": (9, 0), "h200": (9, 0), "gh200": (9, 0),
    "b200": (10, 0), "gb200": (10, 0), "b300": (10, 3), "gb300": (10, 3), "rtx-pro-6000": (12, 0),
    "rtx-5090": (12, 0),
}
OBJECTIVES = ("memory", "fp8-flops")
#: target name -> (inclusive low, high, unit); exactly one is given
TARGETS: dict[str, tuple[float, float, str]] = {
    "target_kl": (1e-6, 10.0, "nats per token (mean KL of the next-token distributions)"),
    "max_ppl_increase": (1e-6, 1000.0, "perplexity points over the source's"),
    "min_sqnr_db": (0.0, 300.0, "dB (every planned layer's output SQNR)"),
}
PLAN_KEYS = (*TARGETS, "objective", "gpu")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True, kw_only=True)
class PlanSettings:
    """A plan request: exactly one of ``target_kl``, ``max_ppl_increase``, ``min_sqnr_db``; ``objective``; ``gpu``."""

    target_kl: float | None = None
    max_ppl_increase: float | None = None
    min_sqnr_db: float | None = None
    objective: str = "memory"
    gpu: str = "h100"

    def __post_init__(self) -> None:
        given = [name for name in TARGETS if getattr(self, name) is not None]
        if len(given) != 1:
            raise RequestError("a plan needs exactly one target: target_kl, max_ppl_increase or min_sqnr_db "
                               f"(got {', '.join(given) or 'none'})", field="plan")
        name = given[0]
        low, high, unit = TARGETS[name]
        value = getattr(self, name)
        if not _number(value) or not low <= value <= high:
            raise RequestError(f"plan.{name} must be a number from {low:g} to {high:g} {unit}, got {value!r}",
                               field=f"plan.{name}")
        if self.objective not in OBJECTIVES:
            raise RequestError(f"plan.objective must be one of {', '.join(OBJECTIVES)}, got {self.objective!r}",
                               field="plan.objective")
        if self.gpu not in GPUS:
            raise RequestError(f"plan.gpu must be one of {', '.join(GPUS)}, got {self.gpu!r}", field="plan.gpu")

    @property
    def target(self) -> tuple[str, float]:
        """The target's name and value."""
        name = next(name for name in TARGETS if getattr(self, name) is not None)
        return name, float(getattr(self, name))

    @classmethod
    def from_dict(cls, data: Any) -> PlanSettings:
        """Raises RequestError naming ``plan.<key>`` for an unknown key or a bad value."""
        if not isinstance(data, Mapping):
            raise RequestError('plan must be a JSON object like {"target_kl": 0.01, "objective": "memory", '
                               '"gpu": "h100"}', field="plan")
        unknown = sorted(set(data) - set(PLAN_KEYS), key=str)
        if unknown:
            raise RequestError(f"unknown plan field {unknown[0]!r}; allowed: {', '.join(PLAN_KEYS)}",
                               field=f"plan.{unknown[0]}")
        return cls(**{key: value for key, value in data.items() if value is not None})

    def to_dict(self) -> dict[str, Any]:
        name, value = self.target
        return {name: value, "objective": self.objective, "gpu": self.gpu}
