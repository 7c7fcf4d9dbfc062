"""Per-layer precision plans: bf16 or a stateless FP8/FP4 recipe per Linear, chosen to meet a target at the least
memory or the most FP8 GEMM FLOPs, verified end to end, and written as the frameworks take it (docs/plan.md)."""

from converters.plan.settings import GPUS, OBJECTIVES, TARGETS, PlanSettings

__all__ = ["GPUS", "OBJECTIVES", "TARGETS", "PlanSettings"]
