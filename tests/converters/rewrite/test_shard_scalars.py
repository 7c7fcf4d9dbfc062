"""The shard rewrite writes 0-dim tensors (the per-tensor scales ModelOpt stores with shape ``[]``)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from converters.model.safetensors_stream import planned_entry, read_tensor, read_tensor_index
from converters.rewrite import Compute, write_shard

SCALARS = {
    "float32": torch.tensor(0.00123, dtype=torch.float32),
    "bfloat16": torch.tensor(-2.5, dtype=torch.bfloat16),
    "float8_e4m3fn": torch.tensor(0.75).to(torch.float8_e4m3fn),
    "int64": torch.tensor(7, dtype=torch.int64),
}


def _bits(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.reshape(-1).view(torch.uint8).tolist())


@pytest.mark.parametrize("name", SCALARS)
def test_a_0_dim_tensor_is_written_with_shape_empty_and_reads_back_equal(tmp_path, name):
    value = SCALARS[name]
    outputs = {"before": planned_entry(torch.float32, (3,)), "scalar": planned_entry(value.dtype, ()),
               "one": planned_entry(value.dtype, (1,))}
    path = tmp_path / "scalars.safetensors"
    write_shard(path, [Compute(outputs=outputs, read=lambda: None,
                               convert=lambda _: ([torch.arange(3, dtype=torch.float32), value, value.reshape(1)],
                                                  None))], {"format": "pt"})

    with safe_open(path, "pt") as handle:  # the safetensors library's own reader
        scalar, one = handle.get_tensor("scalar"), handle.get_tensor("one")
        assert torch.equal(handle.get_tensor("before"), torch.arange(3, dtype=torch.float32))
    assert (scalar.dtype, tuple(scalar.shape)) == (value.dtype, ())
    assert (one.dtype, tuple(one.shape)) == (value.dtype, (1,))
    assert _bits(scalar) == _bits(one) == _bits(value)  # bit for bit

    tensors, _ = read_tensor_index(path)
    assert tensors["scalar"].shape == () and tensors["scalar"].nbytes == value.element_size()
    again = read_tensor(tensors["scalar"])
    assert tuple(again.shape) == () and _bits(again) == _bits(value)


def test_a_0_dim_tensor_against_a_1_element_plan_is_refused(tmp_path):
    step = Compute(outputs={"s": planned_entry(torch.float32, (1,))}, read=lambda: None,
                   convert=lambda _: ([torch.tensor(1.0)], None))
    with pytest.raises(ValueError, match="does not match the plan"):
        write_shard(tmp_path / "x.safetensors", [step], {})
    assert list(tmp_path.iterdir()) == []
