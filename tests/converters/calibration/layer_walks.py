"""The calibration walk's side of an ``after_layer`` callback, for tests that hand it plain modules as layers."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from converters.calibration.sequential import LayerPass


def walk_layers(layers: Sequence[nn.Module], inputs: list[torch.Tensor], after_layer: Callable[[LayerPass], None]
                ) -> None:
    """Each layer (path ``model.layers.<i>``) on ``inputs``, its high-precision outputs the next layer's inputs,
    then ``after_layer`` with its pass."""
    for index, layer in enumerate(layers):
        outputs = [layer(hidden) for hidden in inputs]
        after_layer(LayerPass(index=index, path=f"model.layers.{index}", layer=layer, linear_paths=[], amax={},
                              outputs=outputs, inputs=inputs,
                              call=lambda module, step, hidden=None, inputs=inputs: module(
                                  inputs[step] if hidden is None else hidden)))
        inputs = outputs
