"""The synchronous analysis of ``POST /v1/analyze`` (and ``fp8forge analyze --calibrate``): a short calibration
inside the request that reports each eligible layer's SQNR (:mod:`converters.calibration.sensitivity`), within bounds
that keep the answer to seconds for a small model.
"""

from __future__ import annotations

from typing import Any

from converters.analysis.eligibility import analyze_model_reference
from converters.errors import RequestError
from converters.pipeline.driver import run_stage, run_stages
from converters.pipeline.progress import Unit
from converters.pipeline.quality_report import add_comparison_quality
from converters.pipeline.request import SYNC_MAX_PARAMETERS
from converters.pipeline.state import NullSink, Run, Stage

__all__ = ["calibrated_analysis", "analysis_report"]


def calibrated_analysis(request: Any, sources: Any, *, sink: Any = None, max_parameters: int | None = None
                        ) -> dict[str, Any]:
    """The analysis report of ``request.model`` with each eligible layer's SQNR; nothing is converted or written.

    Runs the pipeline's resolve, analyze and calibrate stages (layer by layer where the model allows), so the
    numbers are the ones a conversion with the same request would report; ``request.compare_recipes`` adds the
    comparison table, each recipe with its end-to-end quality (perplexity, KL, top-1 agreement) on held-out texts,
    and ``request.min_sqnr_db`` marks the layers it would keep in high precision. The report
    gains ``calibration`` (settings, data source, mode) and ``warnings``.

    Raises the pipeline's Fp8ForgeError subclasses, and RequestError (field ``model``) for a model of more
    than ``max_parameters`` parameters.
    """

    plain = analyze_model_reference(request.model, sources, backend=request.parsed_recipe().backend.value,
                                    include=request.include, exclude=request.exclude,
                                    skip_first_last=request.skip_first_last,
                                    convert_router_gates=request.convert_router_gates)
    size = plain["totals"]["model_parameters"]
    if max_parameters is not None and size > max_parameters:
        raise RequestError(f"the model has {size:,} parameters; a synchronous analysis calibrates at most "
                           f"{max_parameters:,}: run `fp8forge compare` on a worker machine, or a conversion job "
                           "(its report holds the SQNR under its recipe)", field="model")
    if plain["totals"]["eligible_layers"] + plain["totals"]["eligible_expert_units"] == 0:
        plain["warnings"] = ["no layer is eligible for FP8: nothing was calibrated"]
        return plain
    run = Run(request=request, sources=sources, sink=sink or NullSink())
    run_stages(run, stop_after=Stage.CALIBRATE)
    if run.report.get("comparison"):  # compare_recipes: each recipe's end-to-end quality on held-out texts
        run_stage(run, Stage.QUALITY, add_comparison_quality, run,
                  lambda done, total: run.sink.progress(done, total, Unit.LAYER))
    settings = request.calibration
    run.report["calibration"] = {"steps": settings.steps, "batch_size": settings.batch_size,
                                 "seq_len": settings.seq_len, "data_source": run.calibration.data_source,
                                 "pipeline": run.pipeline}
    run.report["warnings"] = run.warnings
    return run.report


def analysis_report(sources: Any, options: dict[str, Any], request: Any = None) -> dict[str, Any]:
    """The report of ``POST /v1/analyze``, as its analysis process computes it: with a conversion ``request``, the
    calibrated analysis of :func:`calibrated_analysis` (at most :data:`SYNC_MAX_PARAMETERS`); otherwise the plain
    report of ``converters.analysis.eligibility.analyze_model_reference(**options)`` (``options`` holds ``ref`` and its
    keyword arguments).

    Raises the analysis's Fp8ForgeError subclasses (see those functions).
    """
    if request is not None:
        return calibrated_analysis(request, sources, max_parameters=SYNC_MAX_PARAMETERS)
    return analyze_model_reference(sources=sources, **options)
