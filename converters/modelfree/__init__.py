"""Model-free conversion: a checkpoint requantized shard by shard from its files and config.json alone.

No model class and no remote code: eligibility comes from tensor names and shapes
(:mod:`converters.modelfree.eligibility`), the work is split into per-shard tasks of plain data
(:mod:`converters.modelfree.tasks`) that :func:`convert_model_free` runs in order (:mod:`converters.modelfree.driver`).
Targets: the serving formats that need no calibration, and ``bf16`` (:mod:`converters.modelfree.targets`).
"""

from __future__ import annotations

from converters.modelfree.driver import REPORT_NAME, convert_model_free, plan_model_free, serving_selection
from converters.modelfree.eligibility import ModelFreeOptions, report_from_headers
from converters.modelfree.targets import MODEL_FREE_TARGETS, model_free_target

__all__ = ["MODEL_FREE_TARGETS", "REPORT_NAME", "ModelFreeOptions", "convert_model_free",
           "model_free_target", "plan_model_free", "report_from_headers", "serving_selection"]
