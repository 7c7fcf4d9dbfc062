"""safetensors files read one tensor at a time, and the plan entries of the tensors a rewrite computes.

A serving export rewrites only the weights of quantized Linears; every other tensor must reach the output
exactly as the source stored it, and a job may hold one tensor in memory, not one shard. The format is
simple enough to stream: an 8-byte little-endian header length, a JSON header (name -> dtype, shape,
data offsets; ``__metadata__``), then the tensors' bytes. This module reads a file's index and one tensor's
bytes at a time (:class:`SourceTensor`, :func:`read_tensor`); writing, the header first from every tensor's
:class:`SourceTensor` or :func:`planned_entry`, then each tensor's bytes once, is :mod:`converters.rewrite`.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from converters.errors import ModelNotFoundError
from converters.model.files import model_file_reader
from converters.model.limits import read_safetensors_header, weight_file_error

__all__ = ["PlannedTensor", "ReadBuffers", "SourceTensor", "dtype_name", "planned_entry", "read_tensor",
           "read_tensor_index"]

_DTYPE_NAMES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
#: Bytes per element of every safetensors dtype a header may name (the sub-byte F4/F6 types are not read here).
_ITEM_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``torch.float8_e4m3fn`` -> ``F8_E4M3``)."""
    return _DTYPE_NAMES[dtype]


@dataclass(frozen=True)
class SourceTensor:
    """Where one tensor's bytes lie in a safetensors file."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  #: absolute file offset of the first byte
    end: int  #: absolute file offset after the last byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_tensor(source: SourceTensor, buffers: ReadBuffers | None = None) -> torch.Tensor:
    """One tensor's bytes read with ``pread`` into its own memory (no file mapping stays behind once it is freed):
    a buffer of ``buffers`` that nothing holds any more, or a fresh one."""
    dtype = next(dtype for dtype, name in _DTYPE_NAMES.items() if name == source.dtype)
    if not source.nbytes:
        return torch.empty(source.shape, dtype=dtype)
    data = bytearray(source.nbytes) if buffers is None else buffers.take(source.nbytes)
    view, done = memoryview(data)[:source.nbytes], 0
    with model_file_reader(source.path) as handle:
        while done < source.nbytes:
            count = os.preadv(handle.fileno(), [view[done:]], source.start + done)
            if count <= 0:
                raise OSError(f"{source.path}: short read at byte {source.start + done}")
            done += count
    del view  # a memoryview left on the buffer would count as a holder of it
    count = source.nbytes // _ITEM_BYTES[source.dtype]
    return torch.frombuffer(data, dtype=dtype, count=count).reshape(source.shape)


class ReadBuffers:
    """Read buffers reused from tensor to tensor: a fresh buffer is zero-filled and then page-faulted in by the
    read, which costs about as much CPU as the read's copy itself (a job reads every weight it converts).

    A buffer is handed out again only once no tensor uses it: ``torch.frombuffer`` holds a reference to the buffer
    for as long as any tensor (or view) of its memory lives, so a buffer with no reference but the pool's is free.
    Holds at most ``kept`` buffers (the largest tensors read lately), for as long as the pool lives: give each
    job (a shard's task) its own. Two by default: a shard rewrite reads one tensor ahead of the one it converts, and
    a buffer kept beyond the reads in flight is memory no other allocation can use.
    """

    def __init__(self, kept: int = 2) -> None:
        self.kept = kept
        self._buffers: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bytearray:
        """A buffer of at least ``nbytes`` that no tensor uses (its contents undefined)."""
        with self._lock:
            # a buffer's references: the pool's list and getrefcount's argument, and one per tensor of its memory
            free = [index for index in range(len(self._buffers)) if sys.getrefcount(self._buffers[index]) <= 2]
            fitting = [index for index in free if len(self._buffers[index]) >= nbytes]
            if fitting:
                return self._buffers[min(fitting, key=lambda index: len(self._buffers[index]))]
            buffer = bytearray(nbytes)
            if len(self._buffers) < self.kept:
                self._buffers.append(buffer)
            elif free:  # the smallest free one gives way to this larger one
                self._buffers[min(free, key=lambda index: len(self._buffers[index]))] = buffer
            return buffer


def read_tensor_index(path: Path) -> tuple[dict[str, SourceTensor], dict[str, str]]:
    """The tensors of a safetensors file (in file order) and its metadata, from the header alone.

    The header is checked against the file before it is trusted: its length, every tensor's dtype, shape and
    byte range (inside the data, the size the dtype and shape need, no two overlapping), string metadata; it is
    read within ``converters.model.limits``' bounds (bytes, tensors) before it is parsed.

    Raises:
        ModelNotFoundError: the file is not a well-formed safetensors file; the message names the file (by
            its name, not its server path) and what is wrong.
        ModelConfigError: a header over the limits (``read_safetensors_header``).
    """
    path = Path(path)
    with model_file_reader(path) as handle:
        size = os.fstat(handle.fileno()).st_size
        header, base = read_safetensors_header(handle, name=path.name)
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(path, "its __metadata__ is not an object of strings")
    tensors = {name: _source_tensor(path, name, info, base, size) for name, info in header.items()}
    ordered = sorted(tensors.items(), key=lambda item: (item[1].start, item[1].end))
    for (_, before), (name, after) in zip(ordered, ordered[1:], strict=False):
        if after.start < before.end:
            raise _corrupt(path, f"tensor {name!r} overlaps the bytes of another tensor")
    return dict(ordered), metadata


def _source_tensor(path: Path, name: str, info: object, base: int, size: int) -> SourceTensor:
    if not isinstance(info, dict):
        raise _corrupt(path, f"tensor {name!r} has no dtype/shape/data_offsets entry")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in _ITEM_BYTES:
        raise _corrupt(path, f"tensor {name!r} has dtype {str(dtype)[:20]!r}, not one fp8forge reads")
    if not isinstance(shape, list) or not all(type(dim) is int and dim >= 0 for dim in shape):
        raise _corrupt(path, f"tensor {name!r} has a shape that is not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= size - base):
        raise _corrupt(path, f"tensor {name!r} has data_offsets outside the file's {size - base} data bytes")
    elements = 1
    for dim in shape:
        elements *= dim
    if offsets[1] - offsets[0] != elements * _ITEM_BYTES[dtype]:
        raise _corrupt(path, f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes; its dtype and shape need "
                             f"{elements * _ITEM_BYTES[dtype]}")
    return SourceTensor(path=path, dtype=dtype, shape=tuple(shape), start=base + offsets[0], end=base + offsets[1])


def _corrupt(path: Path, why: str) -> ModelNotFoundError:
    return weight_file_error(path.name, why)


@dataclass(frozen=True)
class PlannedTensor:
    """A tensor of a file being written whose bytes are computed later: its safetensors dtype name, shape and size."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def planned_entry(dtype: torch.dtype, shape: tuple[int, ...]) -> PlannedTensor:
    """The plan entry of a tensor computed later (a quantized weight, its scales), for a rewrite's header."""
    numel = 1
    for size in shape:
        numel *= size
    return PlannedTensor(dtype=dtype_name(dtype), shape=tuple(shape), nbytes=numel * _element_size(dtype))


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


