"""Output formats by name, each a module behind one protocol.

Training formats (:class:`~converters.formats.training.TrainingFormat`): the artifact of a recipe's
backend, ``te`` or ``ao``. Serving formats (:class:`~converters.formats.serving.ServingFormat`): extra
checkpoints a job lists by name, each in ``serving/<name>/`` of the artifact. A new format is one module
plus one entry here."""

from __future__ import annotations

from converters.errors import Fp8ForgeError
from converters.formats.compressed_tensors import DYNAMIC, STATIC
from converters.formats.fp8_block import FP8_BLOCK
from converters.formats.serving import ServingFormat
from converters.formats.te_training import TE
from converters.formats.torchao_training import TORCHAO
from converters.formats.training import TrainingFormat

__all__ = ["SERVING_FORMATS", "TRAINING_FORMATS", "serving_format", "training_format"]

SERVING_FORMATS: dict[str, ServingFormat] = {fmt.name: fmt for fmt in (STATIC, DYNAMIC, FP8_BLOCK)}
TRAINING_FORMATS: dict[str, TrainingFormat] = {fmt.name: fmt for fmt in (TE, TORCHAO)}


def training_format(name: str) -> TrainingFormat:
    """The training format of recipe backend ``name`` (recipes are validated, so it exists)."""
    return TRAINING_FORMATS[name]


def serving_format(name: str, *, field: str = "serving_formats") -> ServingFormat:
    """The format called ``name``; Fp8ForgeError naming ``field`` and the known names otherwise."""
    try:
        return SERVING_FORMATS[name]
    except (KeyError, TypeError):
        raise Fp8ForgeError(f"unknown serving format {name!r}; known: {', '.join(SERVING_FORMATS)}",
                            field=field) from None
