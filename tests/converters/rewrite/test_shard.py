"""The shard-rewrite engine (converters.rewrite.shard) on real safetensors files: what it writes, what it refuses."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from converters.model.safetensors_stream import planned_entry, read_tensor, read_tensor_index
from converters.rewrite import Compute, Copy, planned_bytes, write_shard


@pytest.fixture()
def source(tmp_path):
    tensors = {"a.weight": torch.randn(64, 32, dtype=torch.bfloat16), "norm": torch.randn(32),
               "b.weight": torch.randn(16, 32, dtype=torch.bfloat16), "scalar": torch.tensor(3.0)}
    save_file(tensors, tmp_path / "in.safetensors", metadata={"format": "pt"})
    return tmp_path / "in.safetensors", tensors


def _steps(path, fail_on=None):
    index, _ = read_tensor_index(path)

    def halve(weight):
        if fail_on is not None and weight.shape[0] == fail_on:
            raise RuntimeError("cast failed")
        return [(weight.float() / 2).to(torch.float16), weight.float().abs().amax().reshape(1)], weight.shape[0]

    steps = []
    for name, tensor in index.items():
        if name.endswith(".weight"):
            outputs = {name: planned_entry(torch.float16, tensor.shape),
                       f"{name}_amax": planned_entry(torch.float32, (1,))}
            steps.append(Compute(outputs=outputs, read=lambda tensor=tensor: read_tensor(tensor), convert=halve))
        else:
            steps.append(Copy(name, tensor))
    return steps


def test_computed_tensors_are_written_and_the_others_keep_their_bytes(source, tmp_path):
    path, tensors = source
    steps = _steps(path)
    written = write_shard(tmp_path / "out.safetensors", steps, {"format": "pt"})
    out = tmp_path / "out.safetensors"
    assert written.sha256 == hashlib.sha256(out.read_bytes()).hexdigest()
    assert written.file_bytes == out.stat().st_size and written.bytes == planned_bytes(steps)
    assert written.notes == [64, 16]  # each Compute step's note, in step order
    with safe_open(out, "pt") as handle:
        assert list(handle.keys()) == sorted(written.tensors) and handle.metadata() == {"format": "pt"}
        for name in ("norm", "scalar"):
            assert torch.equal(handle.get_tensor(name), tensors[name])
        for name in ("a.weight", "b.weight"):
            assert torch.equal(handle.get_tensor(name), (tensors[name].float() / 2).to(torch.float16))
            assert float(handle.get_tensor(f"{name}_amax")) == float(tensors[name].float().abs().amax())
    # the header first, in step order, each tensor's bytes right after the one before, padded to 8 bytes with spaces
    data = out.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    text = data[8:8 + length]
    assert length % 8 == 0 and text == text.rstrip(b" ") + b" " * (length - len(text.rstrip(b" ")))
    header = json.loads(text)
    assert list(header) == ["__metadata__", *written.tensors]
    offsets = [header[name]["data_offsets"] for name in written.tensors]
    assert offsets[0][0] == 0 and all(end == start for (_, end), (start, _) in zip(offsets, offsets[1:], strict=False))
    assert 8 + length + offsets[-1][1] == len(data)


def test_a_failing_cast_leaves_nothing_behind(source, tmp_path):
    path, _ = source
    with pytest.raises(RuntimeError, match="cast failed"):
        write_shard(tmp_path / "out.safetensors", _steps(path, fail_on=16), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


def test_a_failing_read_is_raised_as_itself(source, tmp_path):
    path, _ = source
    steps = _steps(path)

    def unreadable():
        raise OSError("disk gone")

    first = next(n for n, step in enumerate(steps) if isinstance(step, Compute))
    steps[first] = Compute(outputs=steps[first].outputs, read=unreadable, convert=steps[first].convert)
    with pytest.raises(OSError, match="disk gone"):
        write_shard(tmp_path / "out.safetensors", steps, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


def test_a_tensor_that_does_not_match_its_plan_is_refused_naming_it(source, tmp_path):
    path, _ = source
    steps = _steps(path)
    computed = [step for step in steps if isinstance(step, Compute)]
    copied = [step for step in steps if isinstance(step, Copy)]
    wrong = Compute(outputs=computed[0].outputs, read=computed[0].read,
                    convert=lambda weight: ([weight, torch.zeros(1)], None))  # bf16 where float16 was planned
    with pytest.raises(ValueError, match=r"a\.weight: torch\.bfloat16 .* does not match the plan"):
        write_shard(tmp_path / "out.safetensors", [wrong, *copied], {})
    with pytest.raises(ValueError, match="both named 'norm'"):
        write_shard(tmp_path / "out.safetensors", [Copy("norm", copied[0].source)] * 2, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]


def test_the_sha256_is_the_written_files_when_copies_go_through_many_reused_buffers(source, tmp_path, monkeypatch):
    """The hasher thread hashes behind the writer: with copy buffers of 40 bytes, every copied tensor passes through
    both buffers many times over, and a buffer must not be refilled before it is hashed."""
    import converters.rewrite.shard as shard

    monkeypatch.setattr(shard, "_COPY_CHUNK", 40)
    path, tensors = source
    written = write_shard(tmp_path / "out.safetensors", _steps(path), {"format": "pt"})
    out = tmp_path / "out.safetensors"
    assert written.sha256 == hashlib.sha256(out.read_bytes()).hexdigest()
    with safe_open(out, "pt") as handle:
        assert torch.equal(handle.get_tensor("norm"), tensors["norm"])


def test_a_failing_write_is_raised_as_itself(source, tmp_path):
    path, _ = source
    with pytest.raises(FileNotFoundError):
        write_shard(tmp_path / "missing" / "out.safetensors", _steps(path), {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.safetensors"]
