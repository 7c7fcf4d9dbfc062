"""What every recipe carries for the serving exports written from its calibration (``serving_formats``).

A job's serving checkpoints are quantized from the same calibration whatever its training recipe, so these
fields sit on every recipe class (a frozen dataclass base each recipe dataclass inherits). A field left at its
default is left out of ``to_dict()``: a recipe recorded before the field existed and one that leaves it at the
default are the same dictionary, so artifacts and request hashes stay as they were and the version stays 1
(a version bump is for a dictionary whose meaning changes; an older fp8forge refuses the unknown key by name).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from converters.recipes.base import NVFP4Smoothing, NVFP4WeightRounding, NVFP4WeightScales, coerce_enum

__all__ = ["SERVING_KEY", "ServingOptions"]

#: field metadata marking a serving option: a recipe key, but never an argument of the training library's class
SERVING_KEY = "serving_option"


@dataclass(frozen=True, kw_only=True)
class ServingOptions:
    """Serving-export options shared by every recipe class; subclasses call :meth:`_check_serving_options`."""

    #: how the NVFP4 serving exports choose their weight block scales (rtn: the peers' bytes)
    nvfp4_weight_scales: NVFP4WeightScales = field(default=NVFP4WeightScales.RTN, metadata={SERVING_KEY: True})
    #: how the NVFP4 exports round their weights onto E2M1 under their scales (nearest: the peers' bytes)
    nvfp4_weight_rounding: NVFP4WeightRounding = field(default=NVFP4WeightRounding.NEAREST,
                                                       metadata={SERVING_KEY: True})
    #: whether the job smooths its source for the NVFP4 W4A4 exports first (none: the source as it is)
    nvfp4_smoothing: NVFP4Smoothing = field(default=NVFP4Smoothing.NONE, metadata={SERVING_KEY: True})

    def _check_serving_options(self) -> None:
        object.__setattr__(self, "nvfp4_weight_scales", coerce_enum(
            self.nvfp4_weight_scales, NVFP4WeightScales, "nvfp4_weight_scales", upper=False))
        object.__setattr__(self, "nvfp4_weight_rounding", coerce_enum(
            self.nvfp4_weight_rounding, NVFP4WeightRounding, "nvfp4_weight_rounding", upper=False))
        object.__setattr__(self, "nvfp4_smoothing", coerce_enum(
            self.nvfp4_smoothing, NVFP4Smoothing, "nvfp4_smoothing", upper=False))

    def serving_options(self) -> dict[str, Any]:
        """The serving options that differ from their defaults, as ``to_dict()`` records them."""
        options = {}
        if self.nvfp4_weight_scales is not NVFP4WeightScales.RTN:
            options["nvfp4_weight_scales"] = self.nvfp4_weight_scales.value
        if self.nvfp4_weight_rounding is not NVFP4WeightRounding.NEAREST:
            options["nvfp4_weight_rounding"] = self.nvfp4_weight_rounding.value
        if self.nvfp4_smoothing is not NVFP4Smoothing.NONE:
            options["nvfp4_smoothing"] = self.nvfp4_smoothing.value
        return options
