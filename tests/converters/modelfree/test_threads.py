"""A requantize's shard tasks cast on one torch thread (the job's parallelism is its workers), and leave the
caller's thread count as they found it."""

from __future__ import annotations

import torch

from converters.modelfree import convert_model_free
from converters.modelfree.targets import MODEL_FREE_TARGETS


def test_the_casts_run_on_one_thread_and_the_callers_count_is_restored(tmp_path, monkeypatch):
    from converters.model.demo import build_tiny_llama

    source = build_tiny_llama(tmp_path / "llama")
    fmt = MODEL_FREE_TARGETS["fp8-block"]
    seen = []
    original = type(fmt).quantize

    def quantize(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(type(fmt), "quantize", quantize)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        convert_model_free(source, tmp_path / "out", "fp8-block")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
