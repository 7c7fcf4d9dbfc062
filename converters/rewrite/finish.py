"""A rewritten checkpoint finished beside its shards: index, config.json, side files, JSON files, manifest.

Every writer of a checkpoint (requantize, the calibrated serving export, sync, the plan's mixed exports) ends the
same way once its shards are written; this is that one ending.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from converters.artifact.files import copy_side_files, write_json, write_manifest
from converters.artifact.layout import MANIFEST_NAME
from converters.model.files import INDEX_NAME, FileConfinement, read_model_text

__all__ = ["REMOVE", "finish_checkpoint"]

#: a ``quantization_config`` of REMOVE takes the source's block out of config.json (a dequantized checkpoint)
REMOVE = object()


def finish_checkpoint(source_dir: Path, directory: Path, shards: Iterable[Any], *, quantization_config: Any,
                      confinement: FileConfinement, json_files: Mapping[str, Any] | None = None,
                      manifest: bool = False, shard_files: Iterable[Mapping[str, Any]] = (),
                      config: Mapping[str, Any] | None = None, side_files_from: Path | None = None) -> list[Any]:
    """Write the index (when the source has one), config.json with ``quantization_config`` (:data:`REMOVE`:
    without one), the tokenizer files and generation config, ``json_files`` (name -> JSON value: a format's side
    files, a report) into ``directory``, then, with ``manifest``, the manifest over all of them.

    ``config``: config.json's content before ``quantization_config`` is set (default: the source's config.json);
    ``side_files_from``: the directory the tokenizer files are copied from (default: the source). Both serve a
    checkpoint whose weights and whose model files lie in different directories (sync's retrained weights).

    ``shards``: each written shard's name (``name`` or ``shard``; ``file`` in a mapping), ``tensors`` (in file
    order) and ``bytes`` (tensor bytes), as attributes or mapping keys, in index order. ``shard_files``: manifest
    entries (name, bytes, sha256) of shards their writers hashed; one that is not in ``directory`` (written on
    another machine and uploaded) is listed from its entry.

    Returns the names written (without ``manifest``), else the manifest's entries. Nothing is read outside
    ``confinement``.
    """
    shards = [_shard_fields(shard) for shard in shards]
    written = []
    if (Path(source_dir) / INDEX_NAME).is_file():
        weight_map = {name: file for file, tensors, _ in shards for name in tensors}
        write_json(directory / INDEX_NAME, {"metadata": {"total_size": sum(size for _, _, size in shards)},
                                            "weight_map": weight_map})
        written.append(INDEX_NAME)
    config = dict(config) if config is not None else json.loads(read_model_text(Path(source_dir) / "config.json",
                                                                                 confinement))
    if quantization_config is REMOVE:
        config.pop("quantization_config", None)
    else:
        config["quantization_config"] = quantization_config
    write_json(directory / "config.json", config)
    written.append("config.json")
    written += copy_side_files(Path(side_files_from or source_dir), directory, confinement)
    for name, content in (json_files or {}).items():
        write_json(directory / name, content)
        written.append(name)
    if not manifest:
        return written
    entries = {entry["name"]: entry for entry in shard_files}
    local = write_manifest(directory, {name: entry["sha256"] for name, entry in entries.items()})
    elsewhere = [entry for name, entry in entries.items() if not (directory / name).is_file()]
    if not elsewhere:
        return local
    files = sorted([*local, *elsewhere], key=lambda entry: PurePosixPath(entry["name"]).parts)
    write_json(directory / MANIFEST_NAME, {"version": 1, "files": files})
    return files


def _shard_fields(shard: Any) -> tuple[str, list[str], int]:
    """(file name, tensor names, tensor bytes) of a shard record: a ``ShardWritten``, a requantize ``WriteResult``
    or a serving export's result mapping."""
    if isinstance(shard, Mapping):
        return shard["file"], shard["tensors"], shard["bytes"]
    return getattr(shard, "name", None) or shard.shard, shard.tensors, shard.bytes
