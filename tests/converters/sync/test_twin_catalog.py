"""The torch-free format table (converters.serving_names) against the format objects and the recipes: each name's
layout, cast and needs are the object's own, and every training twin is reached from a recipe by (layout, cast)."""

from __future__ import annotations

import pytest

from converters.errors import RequestError
from converters.recipes import recipe_from_dict
from converters.recipes.presets import RECIPE_NAMES
from converters.serving_names import (
    SERVING_FORMAT_SPECS,
    Layout,
    WeightCast,
    format_spec,
    training_twin_name,
)
from converters.sync.twins import training_twin


def _arithmetic(fmt) -> tuple[WeightCast, str | None]:
    """Whose rounding a format object applies, read from the object's own setting."""
    from converters.serving.fp8_block import FP8Block, ScaleArithmetic
    from converters.serving.mxfp8 import MXFP8Format, MXScaleMode
    from converters.serving.torchao_float8 import TorchaoFloat8, TorchaoGranularity

    if isinstance(fmt, FP8Block):
        return (WeightCast.TE, None) if fmt.arithmetic is ScaleArithmetic.TRANSFORMER_ENGINE \
            else (WeightCast.SERVING, None)
    if isinstance(fmt, MXFP8Format):
        return {MXScaleMode.COMPRESSED_TENSORS: (WeightCast.SERVING, None),
                MXScaleMode.TRANSFORMER_ENGINE: (WeightCast.TE, None),
                MXScaleMode.RCEIL: (WeightCast.TORCHAO, "rceil"),
                MXScaleMode.FLOOR: (WeightCast.TORCHAO, "floor")}[fmt.mode]
    if isinstance(fmt, TorchaoFloat8):
        return (WeightCast.TE, None) if fmt.granularity is TorchaoGranularity.TE_TENSORWISE \
            else (WeightCast.TORCHAO, None)
    return WeightCast.SERVING, None


@pytest.mark.parametrize("spec", SERVING_FORMAT_SPECS, ids=[spec.name for spec in SERVING_FORMAT_SPECS])
def test_each_name_describes_its_format_object(spec) -> None:
    from converters.serving import SERVING_FORMATS
    from converters.serving.loads_in import LAYOUT_OF

    fmt = SERVING_FORMATS[spec.name]
    assert fmt.needs_calibration is spec.calibrated
    assert getattr(fmt, "supports_kv_cache", False) is spec.kv_cache
    assert _arithmetic(fmt) == (spec.cast, spec.scale_mode)
    assert LAYOUT_OF[spec.name] == spec.layout.value
    assert spec.training_twin is (spec.cast is not WeightCast.SERVING)


def test_every_training_twin_is_the_twin_of_a_recipe_of_its_library() -> None:
    recipes = [recipe_from_dict(body) for body in RECIPE_NAMES.values()]
    recipes += [recipe_from_dict({"backend": "te", "scaling": "float8_block", "use_f32_scales": True}),
                recipe_from_dict({"backend": "ao", "scaling": "mxfp8_training_op", "scale_calculation_mode": "floor"})]
    reached = {}
    for recipe in recipes:
        try:
            twin = training_twin(recipe)
        except RequestError:
            continue
        reached[twin.format] = twin
        assert twin.cast is (WeightCast.TE if recipe.backend.value == "te" else WeightCast.TORCHAO)
        assert format_spec(twin.format).layout is twin.layout and format_spec(twin.format).cast is twin.cast
    assert sorted(reached) == sorted(spec.name for spec in SERVING_FORMAT_SPECS if spec.training_twin)


def test_a_layout_and_cast_without_a_format_is_an_error_and_an_unknown_name_names_the_field() -> None:
    with pytest.raises(LookupError, match="nvfp4 with the te cast"):
        training_twin_name(Layout.NVFP4, WeightCast.TE)
    with pytest.raises(RequestError, match="unknown serving format 'gguf'") as info:
        format_spec("gguf", field="serving_formats[0]")
    assert info.value.field == "serving_formats[0]"


def test_requantize_targets_are_the_model_free_targets_in_their_order() -> None:
    from converters.modelfree.targets import MODEL_FREE_TARGETS
    from converters.pipeline.request import REQUANTIZE_TARGETS

    assert REQUANTIZE_TARGETS == tuple(MODEL_FREE_TARGETS)
