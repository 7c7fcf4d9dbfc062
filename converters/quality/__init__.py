"""End-to-end quality of an FP8 model against its source: perplexity, next-token KL and top-1 agreement on
held-out texts, measured layer by layer (README.md beside this file)."""

from converters.quality.casts import ExportFiles, LayerCast, casting_linears, export_layer_casts, recipe_layer_casts
from converters.quality.figures import QUALITY_DEFINITION, QualityFigures
from converters.quality.held_out import BUILT_IN_HELD_OUT, REQUEST_TEXTS, calibration_part, held_out_part
from converters.quality.kv_cache import NEAREST as KV_ROUNDING_NEAREST
from converters.quality.kv_cache import TRUNCATE as KV_ROUNDING_TRUNCATE
from converters.quality.kv_cache import KvCast, export_kv_casts, fake_quantize_kv, quantizing_kv_cache
from converters.quality.measure import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SEQ_LEN,
    QualitySource,
    QualityUnavailable,
    load_source,
    measure_qualities,
    measure_quality,
)

__all__ = ["BUILT_IN_HELD_OUT", "DEFAULT_MAX_TOKENS", "DEFAULT_SEQ_LEN", "KV_ROUNDING_NEAREST", "KV_ROUNDING_TRUNCATE",
           "QUALITY_DEFINITION", "REQUEST_TEXTS", "ExportFiles", "KvCast", "LayerCast", "QualityFigures",
           "QualitySource", "QualityUnavailable", "calibration_part", "casting_linears", "export_kv_casts",
           "export_layer_casts", "fake_quantize_kv", "held_out_part", "load_source", "measure_qualities",
           "measure_quality", "quantizing_kv_cache", "recipe_layer_casts"]
