"""torchao backend: swap the report's eligible ``nn.Linear`` layers for ``Float8Linear``.

torchao is imported here only, inside the functions, so analysis never pays for it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from torch import nn

from converters.errors import ConversionError

__all__ = ["convert_to_torchao", "float8_linear_paths", "torchao_version"]

logger = logging.getLogger(__name__)


def torchao_version() -> str:
    import torchao

    return getattr(torchao, "__version__", "unknown")


def float8_linear_paths(model: nn.Module) -> list[str]:
    """Paths of the ``Float8Linear`` modules in ``model``, in module order."""
    from torchao.float8.float8_linear import Float8Linear

    return [path for path, module in model.named_modules() if isinstance(module, Float8Linear)]


def convert_to_torchao(model: nn.Module, layer_paths: Sequence[str], float8_config: Any) -> list[str]:
    """Swap exactly ``layer_paths`` (the report's eligible layers) for torchao ``Float8Linear``, in place.

    The filter is the report's list itself, never a second rule. Raises ConversionError when a listed
    path is missing, is not an ``nn.Linear``, or when the number of converted modules differs from the
    number listed.
    """
    from torchao.float8 import convert_to_float8_training

    wanted = set(layer_paths)
    modules = dict(model.named_modules())
    for path in layer_paths:
        if not isinstance(modules.get(path), nn.Linear):
            found = type(modules[path]).__name__ if path in modules else "nothing"
            raise ConversionError(f"eligible layer {path!r} is {found} in the loaded model, not nn.Linear")

    convert_to_float8_training(model, config=float8_config, module_filter_fn=lambda _module, fqn: fqn in wanted)
    converted = float8_linear_paths(model)
    if sorted(converted) != sorted(wanted):
        missing = sorted(wanted - set(converted))[:5]
        extra = sorted(set(converted) - wanted)[:5]
        raise ConversionError(
            f"torchao converted {len(converted)} layers but the report called {len(wanted)} eligible "
            f"(not converted: {missing}, unexpected: {extra})"
        )
    logger.info("converted %d layers to Float8Linear", len(converted))
    return converted
