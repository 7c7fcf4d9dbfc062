"""Serving output formats, by name: each a module behind the :class:`~converters.formats.serving.ServingFormat`
protocol. A job lists the names it wants; each lands in ``serving/<name>/`` of the artifact."""

from __future__ import annotations

from converters.errors import Fp8ForgeError
from converters.formats.compressed_tensors import DYNAMIC, STATIC
from converters.formats.fp8_block import FP8_BLOCK
from converters.formats.serving import ServingFormat

__all__ = ["SERVING_FORMATS", "serving_format"]

SERVING_FORMATS: dict[str, ServingFormat] = {fmt.name: fmt for fmt in (STATIC, DYNAMIC, FP8_BLOCK)}


def serving_format(name: str, *, field: str = "serving_formats") -> ServingFormat:
    """The format called ``name``; Fp8ForgeError naming ``field`` and the known names otherwise."""
    try:
        return SERVING_FORMATS[name]
    except (KeyError, TypeError):
        raise Fp8ForgeError(f"unknown serving format {name!r}; known: {', '.join(SERVING_FORMATS)}",
                            field=field) from None
