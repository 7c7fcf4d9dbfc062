"""The conversion pipeline: the request, the stages (resolve -> analyze -> calibrate -> convert -> export), the
driver that runs them with progress and cancellation, and the synchronous calibrated analysis.
"""

from converters._lazy import lazy_exports

#: public name -> the module that defines it (loaded on first use: see converters._lazy)
_EXPORTS = {
    "ConversionRequest": "converters.pipeline.request",
    "CalibrationSettings": "converters.pipeline.request",
    "LIMITS": "converters.pipeline.request",
    "SERVING_FORMAT_NAMES": "converters.pipeline.request",
    "ProgressSink": "converters.pipeline.driver",
    "NullSink": "converters.pipeline.driver",
    "ConversionResult": "converters.pipeline.driver",
    "run_conversion": "converters.pipeline.driver",
    "calibrated_analysis": "converters.pipeline.sync_analysis",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
