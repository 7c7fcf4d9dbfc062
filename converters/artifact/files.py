"""Artifact files: weight files copied from the source, safetensors, JSON, and a checksummed manifest.

Every file is written to a temporary name and moved into place with ``os.replace``; the pipeline also
stages the whole directory and renames it only on success, so a reader never sees half an artifact.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from converters.artifact.layout import MANIFEST_NAME, sha256_file
from converters.errors import ArtifactError
from converters.model.files import INDEX_NAME, FileConfinement, copy_model_file
from converters.model.sources import TOKENIZER_FILES

__all__ = [
    "copy_weight_files",
    "copy_side_files",
    "save_tensors",
    "write_json",
    "write_manifest",
    "verify_manifest",
    "new_file_mode",
    "set_artifact_modes",
]




def copy_weight_files(files: Iterable[Path], directory: Path, confinement: FileConfinement, *,
                      should_stop: Callable[[], bool] | None = None) -> list[str]:
    """Copy a checkpoint's weight files (and its index, if any) into ``directory`` byte for byte.

    TE and torchao artifacts hold the source's weights unchanged, so they are never decoded: the files
    keep the source's tensor names, dtypes and sharding. Each copy goes through a temporary name, and
    reads nothing outside ``confinement`` (the hub cache's links to its blobs are followed, others refused).
    ``should_stop`` is asked before each file; when it says yes the copy stops there.
    Returns the names of the files written.
    """
    files = list(files)
    names = []
    index = files[0].parent / INDEX_NAME if files else None
    for source in [*files, *([index] if index is not None and index.is_file() else [])]:
        if should_stop is not None and should_stop():
            break
        copy_model_file(source, directory / source.name, confinement)
        names.append(source.name)
    return names


def copy_side_files(source: Path, directory: Path, confinement: FileConfinement) -> list[str]:
    """Copy the source model's tokenizer files and generation config into ``directory``; return their names.

    Nothing outside ``confinement`` is read (see :func:`converters.model.files.copy_model_file`).
    """
    copied = []
    for name in [*TOKENIZER_FILES, "generation_config.json"]:
        if (source / name).is_file():
            copy_model_file(source / name, directory / name, confinement)
            copied.append(name)
    return copied


def save_tensors(tensors: Mapping[str, torch.Tensor], path: Path, metadata: Mapping[str, str]) -> None:
    """``safetensors`` ``save_file`` through a temporary name; metadata values must be strings."""
    bad = [key for key, value in metadata.items() if not isinstance(value, str)]
    if bad:
        raise TypeError(f"safetensors metadata must be strings; not strings: {bad}")
    temporary = path.with_name(f".{path.name}.tmp")
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, temporary, metadata=dict(metadata))
    _sort_metadata(temporary)
    os.chmod(temporary, new_file_mode())  # safetensors creates 0600 files; an artifact's files share one mode
    os.replace(temporary, path)


def _sort_metadata(path: Path) -> None:
    """Put the header's metadata in key order: safetensors writes it from a hash map, in an order that changes from
    one process to the next, so the same tensors would give different bytes (and sha256) in different runs."""
    with open(path, "r+b") as handle:
        size = int.from_bytes(handle.read(8), "little")
        text = handle.read(size).decode("utf-8")
        header = json.loads(text)
        header["__metadata__"] = dict(sorted(header.get("__metadata__", {}).items()))
        ordered = json.dumps(header, separators=(",", ":"), ensure_ascii=False)
        if len(ordered.encode("utf-8")) == len(text.rstrip(" ").encode("utf-8")):  # the same JSON, reordered
            handle.seek(8)
            handle.write(ordered.encode("utf-8").ljust(size, b" "))


#: the most an artifact's files allow: owner read/write, group read, others nothing. An artifact holds a tenant's
#: calibration and quality texts and weights; the usual umask (022) would let any local user read them (0644).
ARTIFACT_FILE_MODE = 0o640
#: the same for its directories (group may list them)
ARTIFACT_DIR_MODE = 0o750


def _umask() -> int:
    """The process umask, read without changing it (``os.umask`` sets it, racing other threads' file creation)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):  # not Linux: the usual umask
        return 0o022


def new_file_mode() -> int:
    """The mode of an artifact's files: :data:`ARTIFACT_FILE_MODE` less the process umask (0640 under the usual
    umask, 0600 under 077), never more whatever the umask."""
    return ARTIFACT_FILE_MODE & ~_umask()


def set_artifact_modes(directory: Path, names: Iterable[str]) -> None:
    """Give the files ``names`` (relative POSIX paths under ``directory``), the directories that hold them and
    ``directory`` itself the artifact modes (:func:`new_file_mode`; directories 0750 less the umask), whoever
    wrote them: copies keep no source mode (a 0600 tokenizer file), ``open()`` follows the umask."""
    umask = _umask()
    directories = {Path(directory)}
    for name in names:
        path = Path(directory) / name
        if path.is_symlink():  # no writer makes one; its target is not the artifact's to change
            continue
        os.chmod(path, ARTIFACT_FILE_MODE & ~umask)
        directories.update(path.parents[:len(Path(name).parts) - 1])
    for path in directories:
        os.chmod(path, ARTIFACT_DIR_MODE & ~umask)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` as indented JSON through a temporary file and ``os.replace``."""
    temporary = path.with_name(f".{path.name}.tmp")
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=False)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temporary, path)


def write_manifest(directory: Path, known: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Checksum every file below ``directory`` (written last, so it covers all of them) into manifest.json.

    Names are relative POSIX paths (``serving/<format>/config.json`` for a serving export's files). ``known``
    holds checksums already computed by whoever wrote a file (the background weight copy), by name.
    """
    known = known or {}
    files = (path for path in sorted(directory.rglob("*")) if path.is_file())
    entries = [
        {"name": name, "bytes": path.stat().st_size, "sha256": known.get(name) or sha256_file(path)}
        for path, name in ((path, path.relative_to(directory).as_posix()) for path in files)
        if name != MANIFEST_NAME and not any(part.startswith(".") for part in name.split("/"))
    ]
    write_json(directory / MANIFEST_NAME, {"version": 1, "files": entries})
    # every writer (copies, safetensors, JSON, other workers' shards) ends here: one place gives them one mode
    set_artifact_modes(directory, [*(entry["name"] for entry in entries), MANIFEST_NAME])
    return entries


def verify_manifest(directory: Path) -> list[dict[str, Any]]:
    """Check every file listed in manifest.json (size and sha256). Raises ArtifactError on any mismatch."""
    directory = Path(directory)
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        raise ArtifactError(f"{directory} has no {MANIFEST_NAME}: not an fp8forge artifact (or a partial one)")
    try:
        entries = json.loads(manifest_path.read_text())["files"]
        names = [entry["name"] for entry in entries]
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"{manifest_path} is malformed ({exc}); re-download the artifact") from exc
    for entry, name in zip(entries, names, strict=True):
        parts = name.split("/") if isinstance(name, str) else [""]
        if any(not part or part.startswith(".") or "\\" in part for part in parts):
            raise ArtifactError(f"{manifest_path} lists {name!r}, which is not a file name inside the artifact")
        path = directory / name
        if not path.is_file() or path.stat().st_size != entry["bytes"] or sha256_file(path) != entry["sha256"]:
            raise ArtifactError(f"{path} is missing or differs from manifest.json; re-download the artifact")
    return entries
