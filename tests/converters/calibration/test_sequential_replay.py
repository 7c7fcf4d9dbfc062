"""The public layer-replay API: record each layer's call once, replay the layers one at a time, replay the rest."""

from __future__ import annotations

import pytest
import torch

from converters.calibration.compute import tensor_dtypes
from converters.calibration.sequential import (
    LayerCalls,
    SequentialStats,
    choose_compute,
    module_path,
    record_layer_calls,
    release_layer,
    replaying_outer_modules,
    under,
)
from converters.model.checkpoint import unit_keys
from converters.model.demo import build_tiny_llama
from converters.model.sources import ModelSourceOptions, load_model, load_tokenizer
from converters.quality import load_source

TEXTS = ["The harbor town woke slowly on the first cold morning of autumn.",
         "Delayed scaling derives the scale of this step from the amax history of earlier steps."]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("replay") / "llama", layers=3)


def test_replaying_layer_by_layer_gives_the_whole_model_logits_bit_for_bit(llama_dir):
    tokenizer = load_tokenizer(llama_dir, ModelSourceOptions())
    batches = [{"input_ids": torch.tensor([tokenizer(text)["input_ids"]]), "use_cache": False} for text in TEXTS]
    whole = load_model(llama_dir, ModelSourceOptions())
    with torch.no_grad():
        expected = [whole(**batch).logits for batch in batches]

    source = load_source(llama_dir)  # a meta model and its checkpoint
    model, stack, checkpoint = source.model, source.stack, source.checkpoint
    head_path = module_path(model, model.get_output_embeddings())
    embed_path = module_path(model, model.get_input_embeddings())
    calls = LayerCalls(stack.count, len(batches))
    embedded = record_layer_calls(model, stack, checkpoint, batches, calls, head_path, embed_path,
                                  keep_embeddings=True)
    assert len(embedded) == len(batches) and all(call is not None for layer in calls.calls for call in layer)
    # the checkpoint's own dtype: the plain path, the computations of the whole model in its order
    choose_compute(calls, checkpoint, checkpoint.dtype, SequentialStats())
    hidden = list(calls.hidden_in)
    layers = model.get_submodule(stack.path)
    for index, layer in enumerate(layers):
        dtypes = tensor_dtypes(layer)
        checkpoint.load(unit_keys(model, lambda name, i=index: under(name, f"{stack.path}.{i}")))
        with torch.no_grad():
            hidden = [calls.call(layer, index, step, h) for step, h in enumerate(hidden)]
        hidden = [h[0] if isinstance(h, tuple) else h for h in hidden]
        release_layer(layer, dtypes)
        assert all(t.is_meta and t.dtype == torch.bfloat16 for t in layer.parameters())

    checkpoint.load(unit_keys(model, lambda name: stack.index_of(name) is None and not under(name, embed_path)))
    got = []
    with replaying_outer_modules(model, stack, calls, embedded, hidden), torch.no_grad():
        for step, batch in enumerate(batches):
            calls.step = step
            got.append(model(**batch).logits)
    assert list(model.get_submodule(stack.path)) == list(layers)  # the real layers are back in place
    for logits, want in zip(got, expected, strict=True):
        assert torch.equal(logits, want)
