"""A variant's stream is the reference's until its first cast layer: computed once, with the same figures."""

from __future__ import annotations

import pytest
from torch import nn

from converters.model.demo import build_tiny_llama
from converters.quality import load_source, measure_qualities, recipe_layer_casts
from converters.recipes.presets import parse_compare_recipe

TEXTS = ["The harbor town woke slowly on the first cold morning of autumn, and the gulls argued over the boats.",
         "Delayed scaling derives the scale of this step from the amax history of earlier steps, one per tensor."]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return load_source(build_tiny_llama(tmp_path_factory.mktemp("shared") / "llama", layers=3))


def _variants(source):
    """One variant per layer casting only that layer's Linears (as the precision planner measures units), one
    casting only the head, and one casting everything."""
    recipe = parse_compare_recipe("te-current", "recipe")
    linears = [name for name, module in source.model.named_modules() if isinstance(module, nn.Linear)]
    variants = {f"layer{index}": recipe_layer_casts(recipe, [p for p in linears if f".layers.{index}." in p])
                for index in range(source.stack.count)}
    variants["head"] = recipe_layer_casts(recipe, ["lm_head"])
    variants["all"] = recipe_layer_casts(recipe, linears)
    return variants


def _layer_calls(source, **options):
    """The figures, and how many times each real decoder layer ran."""
    layers = source.model.get_submodule(source.stack.path)
    counts = [0] * len(layers)
    hooks = [layer.register_forward_hook(lambda *_, i=index: counts.__setitem__(i, counts[i] + 1))
             for index, layer in enumerate(layers)]
    try:
        figures = measure_qualities(source, _variants(source), TEXTS, **options)
    finally:
        for hook in hooks:
            hook.remove()
    return figures, counts


def test_sharing_the_reference_until_the_first_cast_layer_keeps_every_figure(source):
    shared, shared_calls = _layer_calls(source)
    separate, separate_calls = _layer_calls(source, share_unchanged_layers=False)
    assert shared == separate
    batches = 1  # both texts in one call: the pass batches its texts
    # without sharing, every stream (the reference and 5 variants) runs every layer on every batch
    assert separate_calls == [6 * batches] * 3
    # with it, layer i runs for the reference and the variants that cast something at or before it
    # (layer0..layer{i} and all): the head-only variant never runs a layer of its own
    assert shared_calls == [(1 + 2) * batches, (1 + 3) * batches, (1 + 4) * batches]


def test_a_variant_casting_a_late_layer_differs_from_the_reference_and_one_casting_nothing_does_not(source):
    figures, _ = _layer_calls(source)
    assert figures["layer2"].kl_mean > 0 and figures["head"].kl_mean > 0
    none = measure_qualities(source, {"none": {}}, TEXTS)["none"]
    assert none.kl_mean == 0.0 and none.perplexity == figures["layer2"].perplexity_reference
