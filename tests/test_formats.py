"""The format registry: every recipe backend has a training format, every format the whole protocol."""

import inspect

import pytest

from converters.formats import SERVING_FORMATS, TRAINING_FORMATS, serving_format, training_format
from converters.formats.serving import ServingFormat
from converters.formats.training import TrainingFormat
from converters.recipes import Backend


def protocol_methods(protocol) -> set[str]:
    return {name for name, _ in inspect.getmembers(protocol, inspect.isfunction) if not name.startswith("_")}


def test_every_recipe_backend_has_a_training_format():
    assert set(TRAINING_FORMATS) == {backend.value for backend in Backend}
    assert all(training_format(name).name == name for name in TRAINING_FORMATS)


@pytest.mark.parametrize(("registry", "protocol"), [(TRAINING_FORMATS, TrainingFormat),
                                                    (SERVING_FORMATS, ServingFormat)])
def test_every_format_implements_its_whole_protocol(registry, protocol):
    for name, fmt in registry.items():
        missing = {method for method in protocol_methods(protocol) if not callable(getattr(fmt, method, None))}
        assert not missing, f"{name} lacks {sorted(missing)}"
        assert fmt.name == name


def test_serving_format_lookup_names_the_field():
    with pytest.raises(Exception, match="known: compressed-tensors-fp8") as info:
        serving_format("gguf", field="serving_formats[3]")
    assert info.value.field == "serving_formats[3]"
