"""A source checkpoint as a model-free job sees it: its tensors, with each weight it stores quantized standing as
the high-precision weight it dequantizes to.

A quantized source (fp8-block, compressed-tensors FP8/NVFP4/MXFP8, ModelOpt; :mod:`converters.model.quantized`)
can be the input of every target: each quantized weight is dequantized (one at a time) and then converted like a
high-precision one, and its companion tensors (scales, ``weight_packed``) and the KV-cache scales are not copied.
A weight's companions may lie in another shard than the weight itself; a task reads them there by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from converters.model.consistency import check_against_config, check_index, check_stored_dtype
from converters.model.limits import read_config_json
from converters.model.quantized import source_quantization
from converters.model.safetensors_stream import ReadBuffers, SourceTensor, dtype_name, read_tensor, read_tensor_index
from converters.modelfree.eligibility import TensorInfo

__all__ = ["ShardReader", "SourceView", "source_view"]


@dataclass(frozen=True)
class SourceView:
    """What eligibility sees (``tensors``) and what the tasks must know of a quantized source."""

    tensors: list[TensorInfo]
    scheme: str | None = None  #: the source's quantization scheme, None for a high-precision source
    stored: dict[str, str] = field(default_factory=dict)  #: quantized weight key -> the tensor storing it
    drop: dict[str, str] = field(default_factory=dict)  #: companion or KV-cache scale name -> its shard
    location: dict[str, str] = field(default_factory=dict)  #: every stored tensor name -> its shard
    #: quantized weight key -> {each of its stored tensors (weight and scales) -> its shard}
    reads: dict[str, dict[str, str]] = field(default_factory=dict)

    def task_fields(self, keys: list[str]) -> dict[str, dict[str, str]]:
        """A shard task's ``stored`` and ``reads`` for the weights ``keys`` of that shard."""
        quantized = [key for key in keys if key in self.stored]
        return {"stored": {key: self.stored[key] for key in quantized},
                "reads": {name: shard for key in quantized for name, shard in self.reads[key].items()}}


def source_view(source_dir: Path, inventories: dict[str, list[list]], dtype: torch.dtype) -> SourceView:
    """The source's tensors from each shard's inventory (``[name, dtype, shape]``), quantized weights dequantized
    to ``dtype`` in name (shape and dtype only: nothing is read here)."""
    location = {name: shard for shard, inventory in inventories.items() for name, _, _ in inventory}
    check_index(source_dir, {shard: [name for name, _, _ in inventory] for shard, inventory in inventories.items()})
    quantization = source_quantization(source_dir)
    if quantization is None:
        view = SourceView(tensors=[TensorInfo(key=name, shard=shard, dtype=kind, shape=tuple(shape))
                                   for shard, inventory in inventories.items() for name, kind, shape in inventory],
                          location=location)
        _check(source_dir, view)
        return view
    shapes = {name: _Shape(tuple(shape)) for inventory in inventories.values() for name, _, shape in inventory}
    stored = {}
    for key in quantization.quantized_weights(location):
        companions = quantization.companion_keys(key)
        stored[key] = key if key in location else next(name for name in companions if name.endswith("_packed"))
        quantization.check_scale_shapes(key, shapes)
    drop = {name: location[name] for key in stored for name in quantization.companion_keys(key)
            if name in location and name != stored[key]}
    drop |= {name: location[name] for name in quantization.kv_cache_keys(location)}
    by_stored = {name: key for key, name in stored.items()}
    tensors = []
    for shard, inventory in inventories.items():
        for name, kind, shape in inventory:
            if name in drop:
                continue
            if name in by_stored:
                key = by_stored[name]
                logical = quantization.logical_shape(key, shapes)
                tensors.append(TensorInfo(key=key, shard=shard, dtype=dtype_name(dtype), shape=tuple(logical)))
            else:
                tensors.append(TensorInfo(key=name, shard=shard, dtype=kind, shape=tuple(shape)))
    reads = {key: {name: location[name] for name in [stored[key], *quantization.companion_keys(key)]
                   if name in location} for key in stored}
    view = SourceView(tensors=tensors, scheme=quantization.scheme.value, stored=stored, drop=drop, location=location,
                      reads=reads)
    _check(source_dir, view)
    return view


def _check(source_dir: Path, view: SourceView) -> None:
    """Refuse what would convert into a wrong checkpoint: FP8 (or packed FP4) codes that no declared quantization
    covers, which would be taken for weights, and projections of another shape than config.json gives.

    Raises:
        ModelConfigError: (field ``model``) naming the shard, the tensor and the fix.
    """
    for info in view.tensors:
        packed = info.dtype in ("U8", "I8") and len(info.shape) == 2 and info.key.endswith(("weight", "weight_packed"))
        if (info.dtype.startswith("F8") or packed) and info.key not in view.stored:
            check_stored_dtype(info.shard, info.key, info.dtype, quantized=False)
    config = read_config_json(Path(source_dir) / "config.json")
    check_against_config(config, ((info.shard, info.key, info.shape) for info in view.tensors))


@dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]


class ShardReader:
    """Reads one shard's tensors by name, a quantized weight dequantized, its scales read wherever they lie."""

    def __init__(self, source_dir: str, shard: str, reads: dict[str, str], dequantize: bool) -> None:
        self.source_dir = Path(source_dir)
        self.shard = shard
        self.reads = reads  #: tensor name -> shard, for the companions stored in other shards
        self.indexes: dict[str, dict[str, SourceTensor]] = {}
        self.quantization = source_quantization(self.source_dir) if dequantize else None
        self.buffers = ReadBuffers()  #: this shard's reads reuse the memory of the tensors they no longer need

    def index(self, shard: str | None = None) -> dict[str, SourceTensor]:
        shard = shard or self.shard
        if shard not in self.indexes:
            self.indexes[shard] = read_tensor_index(self.source_dir / shard)[0]
        return self.indexes[shard]

    def read(self, name: str) -> torch.Tensor:
        """A stored tensor; KeyError when the checkpoint has none of that name."""
        return read_tensor(self.index(self.reads.get(name))[name], self.buffers)

    def weight(self, key: str, stored: str | None, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``key``: read as stored, or (``stored`` given) dequantized to ``dtype``."""
        if stored is None:
            return self.read(key)
        return self.quantization.dequantize(key, self.read, dtype)

    def stored_shape(self, key: str, stored: str) -> tuple[int, ...]:
        return tuple(self.quantization.logical_shape(key, {stored: self.index()[stored]}))
