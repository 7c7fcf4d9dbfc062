"""Serving exports: checkpoints for inference engines, each format a module behind one protocol
(:class:`~converters.serving.selection.ServingFormat`), written to ``serving/<name>/`` of the artifact.

Public surface: ``SERVING_FORMATS``, ``serving_format``, ``ServingFormat``, ``ServingSelection``, ``select_serving``,
``write_serving_checkpoint``. A new format is one module plus one entry in ``SERVING_FORMATS``.
"""

from __future__ import annotations

from converters.errors import Fp8ForgeError
from converters.serving.compressed_tensors import DYNAMIC, STATIC
from converters.serving.fp8_block import FP8_BLOCK, FP8_BLOCK_TE, FP8_BLOCK_UE8M0, FP8_BLOCK_UE8M0_TE
from converters.serving.modelopt import MODELOPT_FP8, MODELOPT_NVFP4
from converters.serving.mxfp8 import MXFP8, MXFP8_FLOOR, MXFP8_RCEIL, MXFP8_TE
from converters.serving.nvfp4 import NVFP4, NVFP4_A16
from converters.serving.selection import ServingFormat, ServingSelection, select_serving
from converters.serving.torchao_float8 import AO_ROWWISE, AO_TENSORWISE, TE_TENSORWISE
from converters.serving.writer import write_serving_checkpoint

__all__ = ["SERVING_FORMATS", "ServingFormat", "ServingSelection", "select_serving", "serving_format",
           "write_serving_checkpoint"]

SERVING_FORMATS: dict[str, ServingFormat] = {fmt.name: fmt for fmt in (STATIC, DYNAMIC, FP8_BLOCK, FP8_BLOCK_UE8M0,
                                                                       MXFP8, NVFP4, NVFP4_A16, MODELOPT_FP8,
                                                                       MODELOPT_NVFP4)}
#: the training twins (converters.sync.twins): each writes a training recipe's own weight casts in a layout above
SERVING_FORMATS |= {fmt.name: fmt for fmt in (FP8_BLOCK_TE, FP8_BLOCK_UE8M0_TE, MXFP8_TE, MXFP8_RCEIL, MXFP8_FLOOR,
                                              AO_TENSORWISE, AO_ROWWISE, TE_TENSORWISE)}


def serving_format(name: str, *, field: str = "serving_formats") -> ServingFormat:
    """The format called ``name``; Fp8ForgeError naming ``field`` and the known names otherwise."""
    try:
        return SERVING_FORMATS[name]
    except (KeyError, TypeError):
        raise Fp8ForgeError(f"unknown serving format {name!r}; known: {', '.join(SERVING_FORMATS)}",
                            field=field) from None
