"""Reads into reused buffers (converters.model.safetensors_stream.ReadBuffers): a tensor still in use keeps its
values whatever is read after it, and a buffer nothing uses any more is read into again."""

from __future__ import annotations

import torch
from safetensors.torch import save_file

from converters.model.safetensors_stream import ReadBuffers, read_tensor, read_tensor_index


def test_a_tensor_in_use_keeps_its_values_and_a_freed_buffer_is_reused(tmp_path):
    tensors = {"a": torch.randn(64, 32, dtype=torch.bfloat16), "b": torch.randn(16, 32),
               "c": torch.arange(100, dtype=torch.int32), "empty": torch.zeros(0, 4)}
    save_file(tensors, tmp_path / "x.safetensors")
    index, _ = read_tensor_index(tmp_path / "x.safetensors")
    buffers = ReadBuffers(kept=2)
    first = read_tensor(index["a"], buffers)
    view = first[8:16]  # a view alone keeps the buffer in use
    address = first.data_ptr()
    del first
    others = [read_tensor(index[name], buffers) for name in ("b", "c", "a", "b")]
    assert torch.equal(view, tensors["a"][8:16])
    assert all(tensor.data_ptr() != address for tensor in others)
    for name, tensor in zip(("b", "c", "a", "b"), others, strict=True):
        assert torch.equal(tensor, tensors[name])
    kept_address = others[0].data_ptr()  # b's: the second buffer kept (a's was in use)
    del view, others
    again = read_tensor(index["b"], buffers)
    assert torch.equal(again, tensors["b"]) and again.data_ptr() == kept_address
    assert read_tensor(index["empty"], buffers).shape == (0, 4)
