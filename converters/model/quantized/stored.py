"""A quantized checkpoint seen as the high-precision checkpoint it stands for, one weight at a time.

The layer-sequential loader (:class:`converters.model.checkpoint.Checkpoint`) and the artifact's weight files
both need the source's weights in the model's own dtype, under the names a high-precision checkpoint has: each
quantized weight under its weight key (``<module>.weight``, even where it is stored as ``weight_packed``), its
scales and the KV-cache scales gone. :class:`StoredWeights` says which stored tensors stand for which weight and
dequantizes one weight on demand (the arithmetic of :meth:`SourceQuantization.dequantize`); nothing is ever
dequantized ahead of its use, so no bf16 copy of the model exists in memory.

:func:`write_dequantized_files` writes those weights as safetensors files (one output file per source file,
same names, the index rewritten), every tensor that is not quantized copied as bytes.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from converters.model.files import INDEX_NAME
from converters.model.limits import read_index_file
from converters.model.quantized.source import SourceQuantization
from converters.model.safetensors_stream import SourceTensor, planned_entry, read_tensor, read_tensor_index
from converters.rewrite.shard import Compute, Copy, write_shard

__all__ = ["StoredWeights", "write_dequantized_files"]


@dataclass(frozen=True)
class StoredWeights:
    """The quantized weights of a checkpoint: ``stored`` maps each weight key to the tensor that holds its codes;
    ``hidden`` are the stored tensors that are not weights of the model (scales, KV-cache scales)."""

    quantization: SourceQuantization
    stored: Mapping[str, str]
    hidden: frozenset[str]
    key_of: Mapping[str, str]  #: stored tensor -> the weight key it holds

    @classmethod
    def of(cls, quantization: SourceQuantization, tensor_names: Iterable[str]) -> StoredWeights:
        """Read from the names of every tensor of the checkpoint (all shards: a scale may lie in another one)."""
        names = set(tensor_names)
        stored = {}
        for key in quantization.quantized_weights(names):
            stored[key] = key if key in names else f"{key.removesuffix('weight')}weight_packed"
        hidden = {name for key, name in stored.items() for name in quantization.companion_keys(key)
                  if name in names and name != stored[key]}
        hidden |= set(quantization.kv_cache_keys(names))
        return cls(quantization=quantization, stored=stored, hidden=frozenset(hidden),
                   key_of={name: key for key, name in stored.items()})

    def logical_name(self, stored_name: str) -> str | None:
        """The name the tensor ``stored_name`` has in the high-precision checkpoint; None for a scale."""
        if stored_name in self.hidden:
            return None
        return self.key_of.get(stored_name, stored_name)

    def logical_shape(self, key: str, sources: Mapping[str, SourceTensor]) -> tuple[int, ...]:
        return tuple(self.quantization.logical_shape(key, sources))

    def dequantize(self, key: str, sources: Mapping[str, SourceTensor], dtype: torch.dtype) -> torch.Tensor:
        """The weight ``key`` in ``dtype``, its codes and scales read from ``sources`` (name -> where it lies).

        Raises:
            ModelConfigError: a stored tensor has the wrong dtype or a shape its scale does not fit.
        """
        return self.quantization.dequantize(key, lambda name: read_tensor(sources[name]), dtype)


def write_dequantized_files(files: list[Path], directory: Path, stored: StoredWeights, dtype: torch.dtype, *,
                            should_stop: Callable[[], bool] | None = None,
                            digests: dict[str, str] | None = None) -> list[str]:
    """Each of ``files`` written into ``directory`` under its own name with every quantized weight dequantized to
    ``dtype`` (under its weight key, in the place of its stored tensor) and the scales left out; every other
    tensor is copied as bytes. The index (when the source has one) maps the written names. ``should_stop`` is
    asked before each file; ``digests``, where given, receives each weight file's sha256 as it was written (a
    manifest need not read the file again). Returns the names written (the index last)."""
    indexes = {path: read_tensor_index(path) for path in files}
    sources = {name: tensor for tensors, _ in indexes.values() for name, tensor in tensors.items()}
    written, weight_map, total = [], {}, 0
    for path, (tensors, metadata) in indexes.items():
        if should_stop is not None and should_stop():
            return written
        steps: list[Copy | Compute] = []
        for name, tensor in tensors.items():
            key = stored.logical_name(name)
            if key is None:
                continue
            if key in stored.stored:
                steps.append(Compute(outputs={key: planned_entry(dtype, stored.logical_shape(key, sources))},
                                     read=functools.partial(stored.dequantize, key, sources, dtype),
                                     convert=lambda weight: ([weight], None)))
            else:
                steps.append(Copy(key, tensor))
        shard = write_shard(directory / path.name, steps, metadata)
        if digests is not None:
            digests[path.name] = shard.sha256
        weight_map.update(dict.fromkeys(shard.tensors, path.name))
        total += shard.bytes
        written.append(path.name)
    if files and (files[0].parent / INDEX_NAME).is_file():
        index = read_index_file(files[0].parent / INDEX_NAME)
        index["weight_map"] = weight_map
        index["metadata"] = {**(index.get("metadata") or {}), "total_size": total}
        temporary = directory / f".{INDEX_NAME}.tmp"
        temporary.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        temporary.replace(directory / INDEX_NAME)
        written.append(INDEX_NAME)
    return written
