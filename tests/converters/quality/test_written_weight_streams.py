"""The quality pass reads each Linear's source weight once per layer when a later stream takes its weights from an
export's written files: such a stream needs no source weight back after an earlier variant's cast replaced it."""

from __future__ import annotations

from dataclasses import replace

import torch
from safetensors import safe_open
from torch import nn

from converters.quality import load_source, measure_qualities, recipe_layer_casts
from converters.quality.casts import cast_linear_weight
from converters.recipes.presets import parse_compare_recipe

TEXTS = ["The harbor town woke slowly on the first cold morning of autumn, and the gulls argued over the boats.",
         "Delayed scaling derives the scale of this step from the amax history of earlier steps, one per tensor."]


def _source_weight(directory, path: str) -> torch.Tensor:
    with safe_open(directory / "model.safetensors", framework="pt") as handle:
        return handle.get_tensor(f"{path}.weight")


def _written(directory, path: str, cast):
    """A read-back cast whose 'written' weight is exactly what ``cast`` makes of the source weight."""
    def read_weight(dtype: torch.dtype) -> torch.Tensor:
        return cast_linear_weight(cast, _source_weight(directory, path), dtype)

    return replace(cast, weight=None, read_weight=read_weight)


def test_a_stream_reading_written_weights_loads_no_source_weight_again(llama_dir, monkeypatch):
    source = load_source(llama_dir)
    paths = [name for name, module in source.model.named_modules()
             if isinstance(module, nn.Linear) and name != "lm_head"]
    training = recipe_layer_casts(parse_compare_recipe("te-current", "recipe"), paths)
    written = {path: _written(llama_dir, path, cast) for path, cast in training.items()}
    loads: dict[str, int] = {}
    load = source.checkpoint.load

    def counting(keys, **kwargs):
        for key in keys:
            loads[key] = loads.get(key, 0) + 1
        return load(keys, **kwargs)

    monkeypatch.setattr(source.checkpoint, "load", counting)
    figures = measure_qualities(source, {"training": training, "serving": written}, TEXTS)
    assert figures["serving"] == figures["training"]  # the same casts, read back: the same figures
    assert figures["training"].kl_mean > 0
    weights = {f"{path}.weight": loads.get(f"{path}.weight", 0) for path in paths}
    assert weights == {key: 1 for key in weights}  # the layer's load only: no reload before the written stream


def test_a_stream_casting_the_source_after_a_written_one_gets_the_source_back(llama_dir):
    source = load_source(llama_dir)
    paths = [name for name, module in source.model.named_modules()
             if isinstance(module, nn.Linear) and name != "lm_head"]
    training = recipe_layer_casts(parse_compare_recipe("te-current", "recipe"), paths)
    written = {path: _written(llama_dir, path, cast) for path, cast in training.items()}
    # the written stream first: the training stream after it must cast the source's weights, not the written ones
    together = measure_qualities(source, {"serving": written, "training": training}, TEXTS)
    alone = measure_qualities(load_source(llama_dir), {"training": training}, TEXTS)
    assert together["training"] == alone["training"] == together["serving"]
