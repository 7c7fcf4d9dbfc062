"""End-to-end quality of an FP8 model against its source: perplexity, next-token KL and top-1 agreement on
held-out texts, measured layer by layer (README.md beside this file)."""

from converters.quality.casts import LayerCast, casting_linears, export_layer_casts, recipe_layer_casts
from converters.quality.figures import QUALITY_DEFINITION, QualityFigures
from converters.quality.held_out import BUILT_IN_HELD_OUT, REQUEST_TEXTS, calibration_part, held_out_part
from converters.quality.measure import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEQ_LEN,
    QualitySource,
    QualityUnavailable,
    load_source,
    measure_qualities,
    measure_quality,
)

__all__ = ["BUILT_IN_HELD_OUT", "DEFAULT_MAX_TOKENS", "DEFAULT_SEQ_LEN", "QUALITY_DEFINITION", "REQUEST_TEXTS",
           "LayerCast", "QualityFigures", "QualitySource", "QualityUnavailable", "calibration_part", "casting_linears",
           "export_layer_casts", "held_out_part", "load_source", "measure_qualities", "measure_quality",
           "recipe_layer_casts"]
