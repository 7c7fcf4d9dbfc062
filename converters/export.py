"""Safetensors artifacts: sharded weights with an index, JSON files, and a checksummed manifest.

Every file is written to a temporary name and moved into place with ``os.replace``; the pipeline also
stages the whole directory and renames it only on success, so a reader never sees half an artifact.
Tied tensors are stored once; the dropped names are recorded in the safetensors metadata.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "MANIFEST_NAME",
    "INDEX_NAME",
    "SINGLE_FILE_NAME",
    "collect_tensors",
    "write_weights",
    "write_json",
    "write_manifest",
    "sha256_file",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """A plain CPU tensor: torchao wraps FSDP-gathered weights in a tensor subclass holding ``_tensor``."""
    while type(tensor) is not torch.Tensor and hasattr(tensor, "_tensor"):
        tensor = tensor._tensor
    if type(tensor) is torch.nn.Parameter:
        tensor = tensor.data
    # `.to` and `.contiguous` return the tensor itself when nothing changes, so tied storages stay shared.
    return tensor.detach().to("cpu").contiguous()


def _storage_key(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.dtype)


def collect_tensors(
    state: Mapping[str, Any], *, drop_suffixes: Iterable[str] = ("_extra_state",)
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Plain, contiguous CPU tensors of a state dict, each storage once.

    Returns ``(tensors, tied)`` where ``tied`` maps every dropped duplicate name to the name kept (the
    first in state-dict order, as transformers keeps the input embedding over a tied head). Entries
    ending in one of ``drop_suffixes`` (TE's pickled ``_extra_state``) are left out.
    """
    drop = tuple(drop_suffixes)
    tensors: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, value in state.items():
        if drop and name.endswith(drop):
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"state entry {name!r} is a {type(value).__name__}, not a tensor")
        value = _plain(value)
        key = _storage_key(value)
        if key in seen:
            tied[name] = seen[key]
            continue
        seen[key] = name
        tensors[name] = value
    return tensors, tied


def _shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_weights(
    tensors: dict[str, torch.Tensor],
    directory: Path,
    *,
    metadata: Mapping[str, str],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write ``tensors`` as ``model.safetensors`` or, above ``max_shard_bytes``, as shards plus an index.

    ``metadata`` values must be strings (the safetensors rule); it is stored in every shard.
    Returns the names of the files written.
    """
    if max_shard_bytes <= 0:
        raise ValueError("max_shard_bytes must be positive")
    bad = [key for key, value in metadata.items() if not isinstance(value, str)]
    if bad:
        raise TypeError(f"safetensors metadata must be strings; not strings: {bad}")
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        _save_atomically({name: tensors[name] for name in shards[0]}, directory / SINGLE_FILE_NAME, metadata)
        return [SINGLE_FILE_NAME]

    files, weight_map = [], {}
    for index, names in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        _save_atomically({name: tensors[name] for name in names}, directory / file_name, metadata)
        files.append(file_name)
        weight_map.update({name: file_name for name in names})
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    write_json(directory / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    return [*files, INDEX_NAME]


def _save_atomically(tensors: dict[str, torch.Tensor], path: Path, metadata: Mapping[str, str]) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    save_file(tensors, temporary, metadata=dict(metadata))
    os.replace(temporary, path)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON through a temporary file and ``os.replace``."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=False)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def sha256_file(path: Path, chunk_bytes: int = 4 * 1024 * 1024) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(directory: Path) -> list[dict[str, Any]]:
    """Checksum every file in ``directory`` (written last, so it covers all of them) into manifest.json."""
    entries = [
        {"name": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}
        for path in sorted(directory.iterdir())
        if path.is_file() and path.name != MANIFEST_NAME and not path.name.startswith(".")
    ]
    write_json(directory / MANIFEST_NAME, {"version": 1, "files": entries})
    return entries
