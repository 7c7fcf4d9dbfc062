"""torchao backend: the report's eligible ``nn.Linear`` layers as ``Float8Linear`` (module swap), or their weights
wrapped by a ``quantize_`` training config (``Float8TrainingOpConfig`` / ``MXFP8TrainingOpConfig``).

A training config keeps the ``nn.Linear`` and wraps its ``weight`` in a training tensor whose matmuls quantize on
the fly (``torchao/prototype/moe_training/tensor.py``); it is applied per weight (``FqnToConfig`` keyed by
``<layer>.weight``), so biases and other layers stay as they are. Where the hardware cannot run the config (an
MXFP8 config off Blackwell, FP8 on a GPU before compute capability 8.9), :func:`load_training_op` leaves the
layers in high precision and says so in ``model.fp8_linears``.

torchao is imported here only, inside the functions, so analysis never pays for it.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from converters.errors import ConversionError

__all__ = ["convert_to_torchao", "float8_linear_paths", "torchao_version", "LinearsPrecision",
           "convert_to_training_op", "training_op_unavailable", "load_training_op"]

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


@dataclass(frozen=True, kw_only=True)
class LinearsPrecision:
    """How a loaded torchao training-config artifact's Linear layers run here (``model.fp8_linears``)."""

    layers: tuple[str, ...]  #: the artifact's ``converted_modules``
    config: str  #: ``Float8TrainingOpConfig`` or ``MXFP8TrainingOpConfig``
    fp8: bool  #: whether their weights are wrapped (low-precision matmuls) here
    note: str  #: what runs in low precision, what in high precision, and why


def _check_linears(model: nn.Module, layer_paths: Sequence[str]) -> None:
    modules = dict(model.named_modules())
    for path in layer_paths:
        if not isinstance(modules.get(path), nn.Linear):
            found = type(modules[path]).__name__ if path in modules else "nothing"
            raise ConversionError(f"eligible layer {path!r} is {found} in the loaded model, not nn.Linear")


def convert_to_training_op(model: nn.Module, layer_paths: Sequence[str], config: Any) -> list[str]:
    """Wrap exactly the weights of ``layer_paths`` (the report's eligible layers) with torchao's training config
    ``config`` via ``quantize_``, in place; works on meta-device models too.

    Raises ConversionError when a listed path is missing or not an ``nn.Linear``, or when the Linear weights wrapped
    afterwards differ from those listed.
    """
    from torchao.prototype.moe_training.tensor import TrainingWeightWrapperBaseTensor
    from torchao.quantization import FqnToConfig, quantize_

    _check_linears(model, layer_paths)
    if layer_paths:
        quantize_(model, FqnToConfig({f"{path}.weight": config for path in layer_paths}), filter_fn=None)
    wrapped = [path for path, module in model.named_modules()
               if isinstance(module, nn.Linear) and isinstance(module.weight, TrainingWeightWrapperBaseTensor)]
    if sorted(wrapped) != sorted(layer_paths):
        raise ConversionError(
            f"torchao wrapped {len(wrapped)} Linear weights with {type(config).__name__} but the report called "
            f"{len(layer_paths)} eligible (not wrapped: {sorted(set(layer_paths) - set(wrapped))[:5]}, unexpected: "
            f"{sorted(set(wrapped) - set(layer_paths))[:5]})")
    logger.info("wrapped %d Linear weights with %s", len(wrapped), type(config).__name__)
    return list(layer_paths)


def training_op_unavailable(recipe: Any, device: str | torch.device) -> str | None:
    """Why ``recipe``'s training config cannot run its low-precision matmuls on ``device`` (None when it can).

    FP8 (``Float8TrainingOpConfig``) runs as ``Float8Linear`` does: on the CPU (torch 2.13 ``_scaled_mm``) and on
    CUDA from compute capability 8.9. MXFP8 runs on CUDA 10.0+ with triton, or anywhere when emulated. Never raises.
    """
    device = torch.device(device)
    hardware = recipe.hardware()
    if hardware.min_capability is None or (device.type == "cpu" and hardware.runs_on_cpu):
        return None
    if device.type != "cuda":
        return f"the model is on {device.type}"
    if not torch.cuda.is_available():
        return f"no CUDA device is visible to torch {torch.__version__}"
    capability = torch.cuda.get_device_capability(device)
    why = hardware.unmet(capability, torch.version.cuda)
    if why is not None:
        return f"this GPU has compute capability {capability[0]}.{capability[1]} and {recipe.library_class}: {why}"
    if hardware.needs_triton and importlib.util.find_spec("triton") is None:
        return f"{recipe.library_class} quantizes with triton kernels, and triton is not installed"
    return None


def load_training_op(model: nn.Module, layer_paths: Sequence[str], recipe: Any, config: Any, *,
                     device: str | torch.device) -> LinearsPrecision:
    """Replay the artifact's training-config wrapping on ``model`` (already on ``device``) where it runs.

    Elsewhere the layers stay ``nn.Linear`` in high precision, the model still trains, and a warning and the
    returned note say so. Raises ConversionError from the wrapping.
    """
    layers = tuple(layer_paths)
    name = type(config).__name__
    why = training_op_unavailable(recipe, device)
    if why is None:
        convert_to_training_op(model, layers, config)
        return LinearsPrecision(layers=layers, config=name, fp8=True,
                                note=f"{len(layers)} Linear weights wrapped with torchao {name}")
    _check_linears(model, layers)
    note = (f"{len(layers)} Linear layers run in high precision here ({why}): torchao {name} needs "
            f"{recipe.hardware().needs}")
    logger.warning("%s", note)
    return LinearsPrecision(layers=layers, config=name, fp8=False, note=note)
