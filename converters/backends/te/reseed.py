"""Re-seeding delayed-scaling state from a few calibration steps on a model's current weights (no TE needed).

Why and how: :mod:`converters.backends.te.resume`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from converters.calibration.amax import record_amax, te_scaling_state
from converters.calibration.batches import calibration_batches
from converters.errors import ConversionError
from converters.recipes import TEDelayedScalingRecipe

__all__ = ["reseed_from_calibration"]


def reseed_from_calibration(model: nn.Module, layer_paths: Sequence[str], recipe: TEDelayedScalingRecipe, *,
                            tokenizer: object | None, steps: int = 4, batch_size: int = 2, seq_len: int = 128,
                            texts: list[str] | None = None, backward: bool = True
                            ) -> dict[str, dict[str, torch.Tensor]]:
    """The delayed-scaling state (``scale_fwd``, ``amax_history_fwd``, ``scale_bwd``, ``amax_history_bwd``) of each
    Linear of ``layer_paths`` after ``steps`` calibration batches through ``model`` (high precision, its own weights).

    ``backward`` also records the gradients' amax, so the backward scales are re-seeded too (the model's parameters
    must require grad). Raises ConversionError for a recipe without state, and the calibration's errors.
    """
    if not isinstance(recipe, TEDelayedScalingRecipe):
        raise ConversionError(f"only delayed scaling keeps an amax history to re-seed; {recipe.library_class} "
                              "computes its scales from each tensor as it casts it", field="reseed_steps")
    batches, _ = calibration_batches(tokenizer, vocab_size=model.config.vocab_size, texts=texts, steps=steps,
                                     batch_size=batch_size, seq_len=seq_len)
    amax = record_amax(model, list(layer_paths), batches, backward=backward)
    return {path: te_scaling_state(amax[path], recipe) for path in layer_paths}
