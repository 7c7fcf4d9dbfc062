"""The synchronous analysis of ``POST /v1/analyze`` (and ``fp8forge analyze --calibrate``): a short calibration
inside the request that reports each eligible layer's SQNR (:mod:`converters.sensitivity`), within bounds that keep
the answer to seconds for a small model.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SYNC_LIMITS", "SYNC_DEFAULTS", "SYNC_MAX_TEXTS_CHARS", "SYNC_MAX_PARAMETERS", "check_sync_calibration",
           "calibrated_analysis", "analysis_report"]

#: Bounds of the calibration /v1/analyze runs synchronously, inside the request (inclusive ranges), and its
#: defaults: at most 4096 tokens, so that the answer comes in seconds for a small model.
SYNC_LIMITS = {"steps": (1, 8), "batch_size": (1, 4), "seq_len": (1, 128), "texts": (1, 64)}
SYNC_DEFAULTS = {"steps": 2, "batch_size": 2, "seq_len": 64}
SYNC_MAX_TEXTS_CHARS = 65_536
#: Largest model /v1/analyze calibrates synchronously; larger ones: ``fp8forge compare`` or a conversion job.
SYNC_MAX_PARAMETERS = 1_000_000_000


def check_sync_calibration(settings: Any) -> None:
    """Refuse calibration settings beyond :data:`SYNC_LIMITS` (the synchronous /v1/analyze path).

    Raises CalibrationDataError naming ``calibration.<field>``.
    """
    from converters.errors import CalibrationDataError

    for name in ("steps", "batch_size", "seq_len"):
        low, high = SYNC_LIMITS[name]
        if not low <= getattr(settings, name) <= high:
            raise CalibrationDataError(
                f"calibration.{name} must be from {low} to {high} for a synchronous analysis; run `fp8forge compare` "
                "or a conversion job for more", field=f"calibration.{name}")
    if settings.backward:
        raise CalibrationDataError("a synchronous analysis runs no backward pass", field="calibration.backward")
    texts = settings.texts or ()
    if len(texts) > SYNC_LIMITS["texts"][1] or sum(len(text) for text in texts) > SYNC_MAX_TEXTS_CHARS:
        raise CalibrationDataError(f"a synchronous analysis takes at most {SYNC_LIMITS['texts'][1]} texts of "
                                   f"{SYNC_MAX_TEXTS_CHARS} characters in all", field="calibration.texts")


def calibrated_analysis(request: Any, sources: Any, *, sink: Any = None, max_parameters: int | None = None
                        ) -> dict[str, Any]:
    """The analysis report of ``request.model`` with each eligible layer's SQNR; nothing is converted or written.

    Runs the pipeline's resolve, analyze and calibrate stages (layer by layer where the model allows), so the
    numbers are the ones a conversion with the same request would report; ``request.compare_recipes`` adds the
    comparison table and ``request.min_sqnr_db`` marks the layers it would keep in high precision. The report
    gains ``calibration`` (settings, data source, mode) and ``warnings``.

    Raises the pipeline's Fp8ForgeError subclasses, and RequestError (field ``model``) for a model of more
    than ``max_parameters`` parameters.
    """
    from converters import stages
    from converters.analysis import analyze_model_reference
    from converters.pipeline import NullSink, _Run
    from converters.requests import RequestError

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
    run = _Run(request=request, sources=sources, sink=sink or NullSink())
    for stage in (stages.resolve, stages.analyze, stages.calibrate):
        run.check_stop()
        run.sink.stage(stage.__name__)
        stage(run)
    settings = request.calibration
    run.report["calibration"] = {"steps": settings.steps, "batch_size": settings.batch_size,
                                 "seq_len": settings.seq_len, "data_source": run.calibration.data_source,
                                 "pipeline": run.pipeline}
    run.report["warnings"] = run.warnings
    return run.report


def analysis_report(sources: Any, options: dict[str, Any], request: Any = None) -> dict[str, Any]:
    """The report of ``POST /v1/analyze``, as its analysis process computes it: with a conversion ``request``, the
    calibrated analysis of :func:`calibrated_analysis` (at most :data:`SYNC_MAX_PARAMETERS`); otherwise the plain
    report of ``converters.analysis.analyze_model_reference(**options)`` (``options`` holds ``ref`` and its
    keyword arguments).

    Raises the analysis's Fp8ForgeError subclasses (see those functions).
    """
    from converters.analysis import analyze_model_reference

    if request is not None:
        return calibrated_analysis(request, sources, max_parameters=SYNC_MAX_PARAMETERS)
    return analyze_model_reference(sources=sources, **options)
