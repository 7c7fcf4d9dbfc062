"""One safetensors shard rewritten: the output header first, then every tensor's bytes once, in file order.

A rewrite is a list of steps, one per source tensor, in the output's order (the shape of compressed-tensors'
``convert_checkpoint``, whose ``Converter`` says per tensor what replaces it):

* :class:`Copy`: a tensor the format does not change, written as its source bytes (never decoded);
* :class:`Compute`: tensors computed from what ``read`` returns (a weight, a quantized weight and its scales):
  ``convert(read())`` gives them in the order of ``outputs``, and a note (the layer's figures) for the caller.

Every output tensor's dtype and shape is known before any byte is computed, so the header is written first and
the file is written once, sequentially. Three threads overlap the work: a reader reads the next step's tensors
(``pread``) while the caller's thread converts this one (torch ops release the GIL), a writer writes the last one
and a hasher computes the file's sha256 behind the writer. Memory: the tensors of three computed steps at most (the
one converted, the next one read, the last one's outputs being written and hashed: each side waits for the other
rather than queue more) and two 4 MiB copy buffers, whatever the shard's size; a copied tensor is never held (its
bytes go through the buffers).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from converters.model.files import model_file_reader
from converters.model.safetensors_stream import SourceTensor, dtype_name, planned_entry

__all__ = ["Compute", "Copy", "ShardWritten", "planned_bytes", "write_shard"]

_COPY_CHUNK = 4 * 1024 * 1024  # two of them: the 8 MiB the writer held when it hashed its own copies
_COPY_BUFFERS = 2  # one being hashed while the next is read and written
_POLL_SECONDS = 0.2  # how often a thread blocked on a queue looks whether another one failed


@dataclass(frozen=True)
class Copy:
    """A source tensor written under ``name`` as its bytes."""

    name: str
    source: SourceTensor


@dataclass(frozen=True)
class Compute:
    """Tensors computed from what ``read()`` returns: ``convert(read()) -> (tensors in outputs' order, note)``.

    ``outputs``: each output name -> a :func:`~converters.model.safetensors_stream.planned_entry` (dtype and
    shape) or the source tensor whose dtype and shape it keeps. ``read`` runs on the reader thread, ``convert`` on
    the caller's.
    """

    outputs: Mapping[str, Any]
    read: Callable[[], Any]
    convert: Callable[[Any], tuple[Sequence[torch.Tensor], Any]]


@dataclass(frozen=True)
class ShardWritten:
    """What :func:`write_shard` wrote: the tensor names in file order, their bytes (what an index's
    ``total_size`` counts), the file's size and sha256, and each :class:`Compute` step's note, in step order."""

    name: str
    tensors: list[str]
    bytes: int
    file_bytes: int
    sha256: str
    notes: list[Any] = field(default_factory=list)

    def file_entry(self) -> dict[str, Any]:
        """The manifest's entry of the file."""
        return {"name": self.name, "bytes": self.file_bytes, "sha256": self.sha256}


def planned_bytes(steps: Sequence[Copy | Compute]) -> int:
    """The tensor bytes :func:`write_shard` writes for ``steps``, from their plan alone."""
    return sum(entry.nbytes for entry in _plan(steps).values())


def write_shard(path: Path, steps: Sequence[Copy | Compute], metadata: Mapping[str, str], *,
                check_stop: Callable[[], None] | None = None) -> ShardWritten:
    """Write the shard ``path`` (through a temporary name beside it, moved into place once complete).

    ``check_stop`` is called before each step; what it raises ends the write (nothing is left behind).

    Raises:
        ValueError: a step's tensors do not have the dtype and shape its plan gave, or two outputs share a name.
        What ``read``, ``convert`` or the file system raise, unchanged.
    """
    plan = _plan(steps)
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    failed = threading.Event()
    reads: queue.Queue = queue.Queue(maxsize=1)
    writes: queue.Queue = queue.Queue(maxsize=1)
    # one computed step read ahead and one being written, at most: the reader takes a slot before it reads a
    # Compute step's tensors (freed when this thread takes them), this thread before it hands a Compute step's
    # outputs to the writer (freed once they are written)
    read_slot, write_slot = threading.Semaphore(1), threading.Semaphore(1)
    reader = _Worker(failed, _read_ahead, steps, reads, read_slot, failed)
    writer = _Worker(failed, _write_file, temporary, _header(plan, metadata), writes, write_slot, failed)
    notes = []
    try:
        for step in steps:
            loaded = _take(reads, failed)
            if check_stop is not None:
                check_stop()
            if isinstance(step, Copy):
                _give(writes, ([step.source], False), failed)
                continue
            read_slot.release()
            tensors, note = step.convert(loaded)
            del loaded  # the weight goes before the next one is taken
            checked = _checked(step, list(tensors), plan)
            del tensors
            _acquire(write_slot, failed)
            _give(writes, (checked, True), failed)
            del checked  # the writer holds the outputs now
            notes.append(note)
        _give(writes, None, failed)
        file_bytes, digest = writer.result()
        reader.result()
        os.replace(temporary, path)
    except BaseException as error:
        failed.set()
        reader.join()
        writer.join()
        temporary.unlink(missing_ok=True)
        if isinstance(error, _Stopped):  # this thread stopped because a worker failed: that failure is the cause
            raise next(worker.error for worker in (reader, writer)
                       if worker.error is not None and not isinstance(worker.error, _Stopped)) from None
        raise
    return ShardWritten(name=path.name, tensors=list(plan), bytes=sum(entry.nbytes for entry in plan.values()),
                        file_bytes=file_bytes, sha256=digest, notes=notes)


def _plan(steps: Sequence[Copy | Compute]) -> dict[str, Any]:
    """Output name -> planned entry (dtype name, shape, nbytes), in file order."""
    plan: dict[str, Any] = {}
    for step in steps:
        outputs = {step.name: step.source} if isinstance(step, Copy) else step.outputs
        for name, entry in outputs.items():
            if name in plan:
                raise ValueError(f"two tensors of the rewritten shard are both named {name!r}")
            plan[name] = _planned(entry)
    return plan


def _planned(entry: Any) -> Any:
    if isinstance(entry, SourceTensor):
        return entry
    if isinstance(entry, torch.Tensor):
        return planned_entry(entry.dtype, tuple(entry.shape))
    return entry


def _header(plan: Mapping[str, Any], metadata: Mapping[str, str]) -> bytes:
    """The safetensors header: 8-byte little-endian length, then JSON padded with spaces to 8 bytes."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, entry in plan.items():
        header[name] = {"dtype": entry.dtype, "shape": list(entry.shape), "data_offsets": [offset,
                                                                                          offset + entry.nbytes]}
        offset += entry.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    return struct.pack("<Q", len(encoded)) + encoded


def _checked(step: Compute, tensors: list[torch.Tensor], plan: Mapping[str, Any]) -> list[torch.Tensor]:
    if len(tensors) != len(step.outputs):
        raise ValueError(f"{next(iter(step.outputs))}: the conversion gave {len(tensors)} tensors, its plan "
                         f"{len(step.outputs)}")
    for name, tensor in zip(step.outputs, tensors, strict=True):
        entry = plan[name]
        if (dtype_name(tensor.dtype), tuple(tensor.shape)) != (entry.dtype, tuple(entry.shape)):
            raise ValueError(f"{name}: {tensor.dtype} {tuple(tensor.shape)} does not match the plan "
                             f"({entry.dtype} {tuple(entry.shape)})")
    return tensors


class _Worker(threading.Thread):
    """A thread whose function's return value or exception the caller collects with :meth:`result`."""

    def __init__(self, failed: threading.Event, function: Callable[..., Any], *args: Any) -> None:
        super().__init__(daemon=True)
        self.failed, self.function, self.args = failed, function, args
        self.value: Any = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.function(*self.args)
        except BaseException as error:  # handed to the caller's thread, which re-raises it
            self.error = error
            self.failed.set()

    def result(self) -> Any:
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


class _Stopped(Exception):
    """Another thread failed: this one stops (the caller re-raises the first failure)."""


def _take(source: queue.Queue, failed: threading.Event) -> Any:
    while True:
        try:
            return source.get(timeout=_POLL_SECONDS)
        except queue.Empty:
            if failed.is_set():
                raise _Stopped() from None


def _give(target: queue.Queue, item: Any, failed: threading.Event) -> None:
    while True:
        try:
            target.put(item, timeout=_POLL_SECONDS)
            return
        except queue.Full:
            if failed.is_set():
                raise _Stopped() from None


def _acquire(slot: threading.Semaphore, failed: threading.Event) -> None:
    while not slot.acquire(timeout=_POLL_SECONDS):
        if failed.is_set():
            raise _Stopped()


def _read_ahead(steps: Sequence[Copy | Compute], reads: queue.Queue, slot: threading.Semaphore,
                failed: threading.Event) -> None:
    for step in steps:
        if isinstance(step, Copy):
            _give(reads, None, failed)
            continue
        _acquire(slot, failed)
        _give(reads, step.read(), failed)


def _write_file(temporary: Path, header: bytes, writes: queue.Queue, slot: threading.Semaphore,
                failed: threading.Event) -> tuple[int, str]:
    """Write the header, then each queued list of tensors (source bytes copied); a hasher thread hashes the same
    bytes in file order behind the writes and frees a list's write slot once its bytes are written and hashed (a
    shard's sha256 costs about what its writes do: on this thread it would add to the writer's time)."""
    # what the hasher is handed is bounded by what it refers to: one computed list's outputs, the copy buffers
    hashes: queue.Queue = queue.Queue()
    free: queue.Queue = queue.Queue()
    for _ in range(_COPY_BUFFERS):
        free.put(bytearray(_COPY_CHUNK))
    hasher = _Worker(failed, _hash_file, header, hashes, slot, free, failed)
    try:
        with open(temporary, "wb", buffering=0) as handle:
            written = handle.write(header)
            while (item := _take(writes, failed)) is not None:
                values, counted = item
                value = data = None
                for value in values:
                    if isinstance(value, SourceTensor):
                        written += _copy_bytes(value, handle, hashes, free, failed)
                        continue
                    # flattened first: a 0-dim tensor (a scalar scale) cannot be viewed as bytes
                    data = memoryview(value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy())
                    written += _write_all(handle, data)
                    hashes.put(_Hash(data))
                hashes.put(_Hash(frees_slot=counted))
                del values, item, value, data  # the hasher holds what it has not hashed yet
        hashes.put(None)
        return written, hasher.result()
    except BaseException as error:
        failed.set()
        hasher.join()
        if isinstance(error, _Stopped) and hasher.error is not None and not isinstance(hasher.error, _Stopped):
            raise hasher.error from None
        raise


@dataclass(frozen=True)
class _Hash:
    """What the hasher is handed: bytes to hash next (a copy buffer's go back to the free buffers once hashed),
    or a list's end (its write slot freed once everything before it is hashed)."""

    data: memoryview | None = None
    buffer: bytearray | None = None
    frees_slot: bool = False


def _hash_file(header: bytes, hashes: queue.Queue, slot: threading.Semaphore, free: queue.Queue,
               failed: threading.Event) -> str:
    """The sha256 of the header and of every queued :class:`_Hash`'s bytes, in order."""
    digest = hashlib.sha256(header)
    while (item := _take(hashes, failed)) is not None:
        if item.data is not None:
            digest.update(item.data)
        if item.buffer is not None:
            free.put(item.buffer)
        if item.frees_slot:
            slot.release()
        del item  # a computed list's outputs go as soon as they are hashed
    return digest.hexdigest()


def _copy_bytes(source: SourceTensor, handle: Any, hashes: queue.Queue, free: queue.Queue,
                failed: threading.Event) -> int:
    """A source tensor's bytes copied through the free copy buffers, read once: each buffer, written, goes to the
    hasher, which frees it."""
    with model_file_reader(source.path) as reader:
        offset = source.start
        while offset < source.end:
            buffer = _take(free, failed)
            view = memoryview(buffer)[:min(len(buffer), source.end - offset)]
            count = os.preadv(reader.fileno(), [view], offset)
            if count <= 0:
                raise OSError(f"{source.path}: short read at byte {offset}")
            _write_all(handle, view[:count])
            hashes.put(_Hash(view[:count], buffer))
            offset += count
    return source.nbytes


def _write_all(handle: Any, data: memoryview) -> int:
    done = 0
    while done < len(data):
        done += handle.write(data[done:])
    return done
