"""The serving exports of a job: planned in analyze (and again when min_sqnr_db drops layers), written in export
from the calibration the job already ran, each with its KV-cache scales where asked, and each audited against the
engine's loading rules before the job may succeed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from converters.calibration.emulation import cast_spec
from converters.calibration.sqnr_meter import RecipeCasts, SqnrMeter
from converters.errors import ConversionError
from converters.model.checkpoint import weight_files
from converters.model.sources import confinement_for, model_dtype
from converters.pipeline.state import Run
from converters.serving import serving_format
from converters.serving.audit import audit_export
from converters.serving.kv_scales import attach_kv_scales
from converters.serving.plan import (
    ServingPlan,
    expert_disk_keys,
    plan_serving,
    set_input_amax,
    write_serving_checkpoint,
)

__all__ = ["SERVING_LABEL", "plan_serving_formats", "serving_casts", "serving_sqnr", "write_serving_exports"]

#: the SQNR meter's label for a serving format's casts: this prefix and the format's name
SERVING_LABEL = "serving:"


def plan_serving_formats(run: Run, report: dict[str, Any]) -> dict[str, ServingPlan]:
    """What each requested serving format quantizes; a format with nothing to quantize is bad input."""
    plans: dict[str, ServingPlan] = {}
    if not run.request.serving_formats:
        return plans
    expert_keys = expert_disk_keys(run.resolved.checkpoint.mapping, run.resolved.checkpoint.target_of, report)
    for index, name in enumerate(run.request.serving_formats):
        plan = plan_serving(serving_format(name), report, run.resolved.checkpoint.on_disk_name, expert_keys)
        if not plan.quantized and not plan.experts:
            raise ConversionError(
                f"serving format {name} would quantize no layer (fused groups must be eligible as a whole; see the "
                "analysis): adjust include/exclude or skip_first_last, or drop the format",
                field=f"serving_formats[{index}]")
        plans[name] = plan
    return plans


def serving_casts(run: Run) -> list[RecipeCasts]:
    """What each requested serving format does to a Linear's weight and input, for the SQNR meter of calibration
    (a format's ``weight_cast`` and ``input_cast``: spec names of converters.calibration.emulation).

    The casts follow the job's library's fp32 scale arithmetic (at most an ulp from the format's own), so a
    format whose casts are the job recipe's (compressed-tensors FP8 after torchao tensorwise) is measured once.
    """
    library = "torchao" if run.recipe.backend.value == "ao" else "te"
    casts = []
    for name in run.request.serving_formats:
        fmt = serving_format(name)
        pow2 = getattr(fmt, "pow2_scales", False)
        input_cast = getattr(fmt, "input_cast", None)
        notes = ("a static input scale comes from the amax over every calibration step: emulated with each step's "
                 "own amax",) if fmt.needs_calibration and input_cast is not None else ()
        casts.append(RecipeCasts(label=f"{SERVING_LABEL}{name}", recipe={"serving_format": name},
                                 weight=cast_spec(fmt.weight_cast, library=library, pow2_scales=pow2),
                                 input=cast_spec(input_cast, library=library, pow2_scales=pow2) if input_cast else None,
                                 not_emulated=notes))
    return casts


def serving_sqnr(run: Run, meter: SqnrMeter | None) -> dict[str, dict[str, dict[str, float | None]]]:
    """Each serving format's SQNR per measured layer, from the calibration's meter (empty when it was off)."""
    if meter is None:
        return {}
    return {name: {path: meter.result(path, f"{SERVING_LABEL}{name}") for path in meter.paths()}
            for name in run.request.serving_formats}


def write_serving_exports(run: Run, staging: Path) -> list[str]:
    """Each requested serving checkpoint in ``serving/<name>/``, from the calibration this job already ran."""
    written = []
    for name, plan in run.serving.items():
        starved = set_input_amax(plan, run.report, run.calibration.amax)
        if starved:
            run.warn(f"{name}: expert GEMM(s) {', '.join(starved)} received no calibration token; their input_scale "
                     "is the largest of the same GEMM's other experts in that layer")
        _attach_kv_cache(run, name, plan)
        directory = staging / "serving" / name
        source = run.resolved.directory
        files = weight_files(source)
        if run.resolved.checkpoint.stored is not None:  # a quantized source: from the artifact's dequantized files
            files = [staging / path.name for path in files]
        files = write_serving_checkpoint(serving_format(name), plan, source, files, directory,
                                         model_dtype(run.resolved.config), confinement_for(run.sources),
                                         check_stop=run.check_stop, emulated_stats=False)
        _add_measured_sqnr(plan, run.calibration.serving_sqnr.get(name, {}))
        _audit(run, name, plan, directory)
        written += [f"serving/{name}/{file}" for file in files]
    return written


def _add_measured_sqnr(plan: ServingPlan, measured: dict[str, dict[str, float | None]]) -> None:
    """Each quantized Linear's and expert unit's SQNR under the format, measured during calibration."""
    for path in [*plan.quantized, *plan.expert_units]:
        if path in measured:
            plan.layer_stats.setdefault(path, {})["sqnr_db"] = measured[path]


def _audit(run: Run, name: str, plan: ServingPlan, directory: Path) -> None:
    """Replay the engine's loading rules on the written export (:mod:`converters.serving.audit`).

    A problem fails the job, naming every tensor the engine would drop or misread: such an export would fail to
    load or run at the wrong scale. A format the audit has no rules for is said in the report and a warning.

    Raises:
        ConversionError: the audit found problems (field ``serving_formats``).
    """
    result = audit_export(directory)
    plan.load_audit = result.to_dict()
    if not result.audited:
        run.warn(f"{name}: the load audit has no rules for this format ({'; '.join(result.notes)})")
        return
    if result.problems:
        shown = "; ".join(f"{problem.rule.value}: {problem.name}: {problem.message}" for problem in result.problems[:5])
        more = f" (and {len(result.problems) - 5} more)" if len(result.problems) > 5 else ""
        raise ConversionError(f"serving format {name}: the export would not load as written in vLLM: {shown}{more}",
                              field="serving_formats")


def _attach_kv_cache(run: Run, name: str, plan: ServingPlan) -> None:
    """With ``kv_cache``: each attention layer's k_scale/v_scale into the plan of a format that writes them."""
    if not run.request.kv_cache or plan.kv_cache:
        return
    fmt = serving_format(name)
    if not getattr(fmt, "supports_kv_cache", False):
        run.warn(f"{name} carries no KV-cache scales (kv_cache applies to the formats that declare them)")
        return
    plan.kv_cache_report = attach_kv_scales(plan, run.calibration.kv_amax, run.resolved.checkpoint.target_of,
                                            model_dtype(run.resolved.config), convention=fmt.kv_scale_convention)
