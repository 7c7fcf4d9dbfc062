"""Calibration: batches from a corpus, amax recording per layer and step (whole model or layer by layer, MoE
experts on their routed tokens), TE's delayed-scaling state and per-layer SQNR (the casts it emulates live in
converters.casts).
"""

from converters._lazy import lazy_exports

#: public name -> the module that defines it (loaded on first use: see converters._lazy)
_EXPORTS = {
    "calibration_batches": "converters.calibration.batches",
    "record_amax": "converters.calibration.amax",
    "LayerAmax": "converters.calibration.amax",
    "FORWARD_SLOTS": "converters.calibration.amax",
    "BACKWARD_SLOTS": "converters.calibration.amax",
    "te_scaling_state": "converters.calibration.amax",
    "calibrate_layer_by_layer": "converters.calibration.sequential",
    "choose_mode": "converters.calibration.sequential",
    "LAYER_SEQUENTIAL": "converters.calibration.sequential",
    "WHOLE_MODEL": "converters.calibration.sequential",
    "delayed_scaling_state": "converters.calibration.scaling",
    "E4M3_MAX": "converters.calibration.scaling",
    "SqnrMeter": "converters.calibration.sqnr_meter",
    "meter_for": "converters.calibration.sensitivity",
    "report_sqnr": "converters.calibration.sensitivity",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
