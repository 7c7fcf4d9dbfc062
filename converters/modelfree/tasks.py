"""The shard tasks of a model-free conversion: map (inventory, weight amax), reduce, write; all plain data.

Each task takes a frozen dataclass of strings, numbers and lists and returns one, so a job queue can send a
shard's task to another machine (``to_dict``/``from_dict`` are the wire form). Only the shard named in a task is
read, one weight at a time, and a write task writes one file. The global decisions (eligibility, the fused
groups' shared weight amax) are made between the phases from the tasks' results
(:mod:`converters.modelfree.driver`).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from converters.casts.emulation import max_abs
from converters.errors import ModelConfigError, RequestError
from converters.model.safetensors_stream import SourceTensor, planned_entry, read_tensor_index
from converters.model.threads import one_intra_op_thread
from converters.modelfree.source import ShardReader
from converters.modelfree.targets import model_free_target
from converters.rewrite import Compute, Copy, planned_bytes
from converters.rewrite import write_shard as rewrite_shard
from converters.serving.writer import quantize_step

__all__ = ["AmaxResult", "AmaxTask", "WriteResult", "WriteTask", "check_device", "inventory_shard",
           "planned_shard_bytes", "reduce_weight_amax", "shard_weight_amax", "write_shard"]

logger = logging.getLogger(__name__)


class _Wire:
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        names = {item.name for item in fields(cls)}
        unknown = set(data) - names
        if unknown:
            raise ValueError(f"{cls.__name__}: unknown fields {sorted(unknown)}")
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class AmaxTask(_Wire):
    """Map: the largest ``|w|`` of each listed weight of one shard."""

    source_dir: str
    shard: str
    keys: list[str]
    scale_dtype: str = "float32"  #: the dtype a quantized source weight is dequantized to
    stored: dict[str, str] = field(default_factory=dict)  #: key stored quantized in the source -> stored tensor
    reads: dict[str, str] = field(default_factory=dict)  #: those weights' stored tensors -> their shards


@dataclass(frozen=True, kw_only=True)
class AmaxResult(_Wire):
    shard: str
    weight_amax: dict[str, float]


@dataclass(frozen=True, kw_only=True)
class WriteTask(_Wire):
    """Write one output shard: the listed weights converted, ``drop`` left out, every other tensor copied as bytes."""

    source_dir: str
    shard: str
    out_dir: str
    target: str
    scale_dtype: str
    convert: list[str]  #: weight keys to convert, in any order
    weight_amax: dict[str, float] = field(default_factory=dict)  #: per converted key (formats needing it)
    stored: dict[str, str] = field(default_factory=dict)  #: weight stored quantized in the source -> stored tensor
    reads: dict[str, str] = field(default_factory=dict)  #: those weights' stored tensors -> their shards
    drop: list[str] = field(default_factory=list)  #: this shard's companions and KV-cache scales, not copied
    planned_bytes: int = 0  #: the tensor bytes the output shard will hold (progress counts them; 0: not planned)
    measure: bool = True  #: each converted weight's SQNR, read from the tensors written, in the result's layer_stats
    #: where the converted weights are cast: "cpu", or a CUDA device (:func:`check_device`); the bytes are the same
    device: str = "cpu"


@dataclass(frozen=True, kw_only=True)
class WriteResult(_Wire):
    shard: str
    tensors: list[str]  #: the names written, in file order
    bytes: int  #: the tensors' bytes (the index's total_size counts these)
    converted: list[str]
    layer_stats: dict[str, dict[str, Any]]
    file: dict[str, Any] = field(default_factory=dict)  #: the manifest's entry of the file (name, bytes, sha256)


def inventory_shard(source_dir: str, shard: str) -> list[list[Any]]:
    """``[name, dtype, shape]`` of every tensor of one shard, in file order, from its header alone."""
    tensors, _ = read_tensor_index(Path(source_dir) / shard)
    return [[name, tensor.dtype, list(tensor.shape)] for name, tensor in tensors.items()]


def shard_weight_amax(task: AmaxTask) -> AmaxResult:
    """Each listed weight's largest magnitude, exact in float32, reading one weight at a time."""
    reader = ShardReader(task.source_dir, task.shard, task.reads, dequantize=bool(task.stored))
    dtype = getattr(torch, task.scale_dtype)
    with one_intra_op_thread():
        # in the weight's dtype (exact there), without fp32 and |w| copies of it: one aminmax pass (+ 0.0: an all-zero
        # weight's -0.0 max reads 0.0, as |w|'s did)
        amax = {key: float(max_abs(reader.weight(key, task.stored.get(key), dtype)).float()) + 0.0
                for key in task.keys}
    for key, value in amax.items():
        if not math.isfinite(value):  # amax propagates NaN: one number says whether the whole weight is finite
            raise ModelConfigError(f"{key} in {task.shard} holds NaN or infinite values, which no quantized "
                                   f"checkpoint can carry. The checkpoint is damaged: fix it or download it again",
                                   field="model")
    return AmaxResult(shard=task.shard, weight_amax=amax)


def reduce_weight_amax(results: list[AmaxResult], shared_under: dict[str, str]) -> dict[str, float]:
    """Each weight's amax, the largest of its group (``shared_under``: weight key -> group), over all shards."""
    by_key = {key: value for result in results for key, value in result.weight_amax.items()}
    group_max: dict[str, float] = {}
    for key, value in by_key.items():
        group = shared_under[key]
        group_max[group] = max(group_max.get(group, 0.0), value)
    return {key: group_max[shared_under[key]] for key in by_key}


def write_shard(task: WriteTask) -> WriteResult:
    """Write ``task.shard`` of the converted checkpoint into ``task.out_dir`` (via a temporary name).

    A weight the source stores quantized is dequantized to ``task.scale_dtype`` first; one that is not converted is
    written in that dtype (the target keeps it in high precision). Every other tensor is copied as its bytes.
    """
    tensors, metadata = read_tensor_index(Path(task.source_dir) / task.shard)
    with one_intra_op_thread():
        written = rewrite_shard(Path(task.out_dir) / task.shard, _steps(task, tensors), metadata)
    stats = dict(note for note in written.notes if note is not None)
    logger.info("%s: %d weights converted", task.shard, len(task.convert))
    return WriteResult(shard=task.shard, tensors=written.tensors, bytes=written.bytes, converted=sorted(task.convert),
                       layer_stats=stats, file=written.file_entry())


def planned_shard_bytes(task: WriteTask) -> int:
    """The tensor bytes :func:`write_shard` writes for ``task`` (what its result's ``bytes`` will say), from the
    shard's header alone: what a job's progress counts its written bytes against."""
    tensors, _ = read_tensor_index(Path(task.source_dir) / task.shard)
    return planned_bytes(_steps(task, tensors))


def _steps(task: WriteTask, tensors: dict[str, SourceTensor]) -> list[Copy | Compute]:
    """The output shard's tensors in file order: each converted weight (or a dequantized one kept in high
    precision) computed, every other tensor copied as bytes, the companions in ``drop`` left out.

    Raises:
        ValueError: the task names tensors the shard does not hold.
    """
    fmt, scale_dtype = model_free_target(task.target), getattr(torch, task.scale_dtype)
    reader = ShardReader(task.source_dir, task.shard, task.reads, dequantize=bool(task.stored))
    key_of = {stored: key for key, stored in task.stored.items()}
    convert, drop = set(task.convert), set(task.drop)
    missing = sorted({*task.stored.values(), *drop, *(convert - set(task.stored))} - set(tensors))
    if missing:
        raise ValueError(f"{task.shard}: the task names tensors the shard does not hold: {missing[:3]}")
    steps: list[Copy | Compute] = []
    for name, tensor in tensors.items():
        key = key_of.get(name, name)
        if name in drop:
            continue
        read = functools.partial(reader.weight, key, name if name in key_of else None, scale_dtype)
        if key in convert:
            if task.device != "cpu":
                read = functools.partial(_to_device, read, torch.device(task.device))
            shape = reader.stored_shape(key, name) if name in key_of else tensor.shape
            # a weight the source stores quantized was checked finite where it was dequantized, and one with a
            # weight amax where that amax was taken (shard_weight_amax: it propagates NaN)
            checked = key in task.stored or key in task.weight_amax
            options = {"weight_amax": task.weight_amax.get(key)} if getattr(fmt, "needs_weight_amax", False) else {}
            steps.append(quantize_step(fmt, key, _Shaped(tuple(shape)), read, scale_dtype, options=options,
                                       label=key.removesuffix(".weight") if task.measure else None,
                                       check_weight=not checked))
        elif name in key_of:
            shape = reader.stored_shape(key, name)
            steps.append(Compute(outputs={key: planned_entry(scale_dtype, shape)}, read=read,
                                 convert=lambda weight: ([weight], None)))
        else:
            steps.append(Copy(name, tensor))
    return steps


def check_device(device: str) -> str:
    """``device`` as a write task takes it: "cpu", or "cuda" / "cuda:N" where torch sees that GPU.

    Raises:
        RequestError: (field ``device``) another device, or a CUDA device this machine's torch does not see.
    """
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        parsed = None
    if parsed is None or parsed.type not in ("cpu", "cuda"):
        raise RequestError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}", field="device")
    if parsed.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise RequestError(f"device {device!r}: this machine's torch sees no CUDA GPU (torch "
                               f"{torch.__version__}); run on a GPU worker or use device 'cpu'", field="device")
        if parsed.index is not None and parsed.index >= count:
            raise RequestError(f"device {device!r}: torch sees {count} CUDA GPU(s), numbered from 0", field="device")
    return "cpu" if parsed.type == "cpu" else str(parsed)


def _to_device(read: Callable[[], torch.Tensor], device: torch.device) -> torch.Tensor:
    """What ``read()`` gives, on ``device`` (runs on the rewrite's reader thread, so the copy overlaps the casts);
    the writer brings the outputs back to host memory."""
    return read().to(device)


@dataclass(frozen=True)
class _Shaped:
    """What a format's ``planned_tensors`` reads of a weight: its (high-precision) shape."""

    shape: tuple[int, ...]

