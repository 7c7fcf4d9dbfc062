"""The format registry: every recipe backend has a training format, every format the whole protocol."""

import inspect

import pytest

from converters.backends import BACKENDS, backend_for, backend_named
from converters.backends.base import Backend as BackendProtocol
from converters.pipeline.request import SERVING_FORMAT_NAMES
from converters.recipes import RECIPE_CLASSES, Backend
from converters.serving import SERVING_FORMATS, serving_format
from converters.serving.selection import ServingFormat


def protocol_methods(protocol) -> set[str]:
    return {name for name, _ in inspect.getmembers(protocol, inspect.isfunction) if not name.startswith("_")}


def test_every_recipe_backend_has_a_backend():
    assert set(BACKENDS) == {backend.value for backend in Backend}
    assert all(backend_named(name).name == name for name in BACKENDS)


def test_every_recipe_class_has_exactly_one_backend_of_its_own_name():
    for cls in RECIPE_CLASSES:
        owners = [backend for backend in BACKENDS.values() if cls in backend.recipe_types]
        assert len(owners) == 1, cls
        assert backend_for(cls()).name == cls().backend.value


@pytest.mark.parametrize(("registry", "protocol"), [(BACKENDS, BackendProtocol),
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


def test_the_torch_free_list_of_serving_format_names_is_the_registry():
    assert tuple(SERVING_FORMATS) == SERVING_FORMAT_NAMES
