"""What the pages need to know that the API also states: stages, statuses, recipe defaults, bounds, names.

Read from the same library constants the API's schema is built from, so the form's defaults and ranges
cannot drift from what the API accepts. No torch is imported.
"""

from __future__ import annotations

from typing import Any

from converters.analysis.patterns import MAX_PATTERNS
from converters.pipeline.request import (
    KV_CACHE_DTYPES,
    KV_CACHE_FORMAT_NAMES,
    LIMITS,
    MIN_SQNR_DB_RANGE,
    REQUANTIZE_TARGETS,
    SERVING_FORMAT_NAMES,
    SYNC_DEFAULTS,
    SYNC_LIMITS,
    CalibrationSettings,
)
from converters.plan.settings import GPUS, OBJECTIVES, TARGETS, PlanSettings
from converters.recipes import (
    MAX_AMAX_HISTORY_LEN,
    MAX_INTERVAL,
    MAX_MARGIN,
    AmaxComputeAlgo,
    AORecipeName,
    Fp8Format,
    TECurrentScalingRecipe,
    TEDelayedScalingRecipe,
    TorchAORecipe,
)
from converters.recipes.presets import RECIPE_NAMES
from service.jobs import STAGES, JobStatus
from service.ui.recipe_variants import recipe_variants, shared_options

__all__ = ["page_config", "form_defaults"]


def form_defaults() -> dict[str, Any]:
    """Defaults, choices and bounds of the new-job and analyze forms (rendered into the HTML)."""
    te, ao, cal = TEDelayedScalingRecipe(), TorchAORecipe(), CalibrationSettings()
    variants = recipe_variants()
    return {
        "te": te.to_dict(),
        "te_current": TECurrentScalingRecipe().to_dict(),
        "ao": ao.to_dict(),
        "fp8_formats": [m.value for m in Fp8Format],
        "amax_compute_algos": [m.value for m in AmaxComputeAlgo],
        "ao_recipe_names": [m.value for m in AORecipeName],
        "max_amax_history_len": MAX_AMAX_HISTORY_LEN,
        "max_margin": MAX_MARGIN,
        "max_interval": MAX_INTERVAL,
        "calibration": {"steps": cal.steps, "batch_size": cal.batch_size, "seq_len": cal.seq_len},
        "limits": {name: {"min": low, "max": high} for name, (low, high) in LIMITS.items()},
        "max_patterns": MAX_PATTERNS,
        "min_sqnr_db": {"min": MIN_SQNR_DB_RANGE[0], "max": MIN_SQNR_DB_RANGE[1]},
        #: the named recipes (analyze's recipe choice and compare_recipes), each a recipe object at its defaults
        "recipe_names": dict(RECIPE_NAMES),
        #: the plan's targets (name -> min, max, unit), objectives and GPUs, with the plan's defaults
        "plan": {"targets": {name: {"min": low, "max": high, "unit": unit}
                             for name, (low, high, unit) in TARGETS.items()},
                 "objectives": list(OBJECTIVES), "gpus": list(GPUS),
                 "objective": PlanSettings.objective, "gpu": PlanSettings.gpu},
        "sync_calibration": {"steps": SYNC_DEFAULTS["steps"], "min": SYNC_LIMITS["steps"][0],
                             "max": SYNC_LIMITS["steps"][1]},
        "serving_formats": list(SERVING_FORMAT_NAMES),
        #: the formats a requantize job (no calibration) writes: RequantizeCreate.to
        "requantize_targets": list(REQUANTIZE_TARGETS),
        "kv_cache_choices": ["none", *KV_CACHE_DTYPES],  #: "none" sends no kv_cache
        "kv_cache_formats": list(KV_CACHE_FORMAT_NAMES),
        "recipe_variants": variants,
        #: the options every recipe takes (nvfp4_weight_scales): one control for whichever recipe is chosen
        "recipe_shared": shared_options(),
        "te_scaling_choices": [("delayed", "delayed (amax history)"), ("current", "current (per cast)"),
                               *((v["scaling"], v["scaling"]) for v in variants if v["backend"] == "te")],
        "ao_scaling_choices": [("float8_linear", "Float8Linear (module swap)"),
                               *((v["scaling"], v["scaling"]) for v in variants if v["backend"] == "ao")],
    }


def page_config() -> dict[str, Any]:
    """The JSON every page's scripts read: how progress is computed and which statuses are final."""
    return {
        "stages": [stage.value for stage in STAGES],
        "statuses": [status.value for status in JobStatus],
        "finished": [status.value for status in JobStatus if status.is_finished],
    }
