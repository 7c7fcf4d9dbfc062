"""Every file a job reads from a model directory stays inside the places models may come from.

A model directory below an allowed root may hold symbolic links; the hub cache is made of them (each
snapshot file links to a blob). A link that leaves those places (``vocab.txt -> <data dir>/api_keys``) would
let one tenant read the server's own files through a conversion and download them as an artifact. So:

- :func:`check_model_directory` resolves every entry of a model directory before anything reads it and
  refuses the first one that resolves outside the allowed roots, the hub cache and the demo directory, or
  into the server's private directories, naming the file;
- :func:`copy_model_file` copies a file without following a link out: it opens the resolved target with
  ``O_NOFOLLOW`` after checking it, so a link swapped in after the check cannot redirect the read.

Hard links cannot be told from the original file and are not checked: making one needs write access to
the target's own file system, which a tenant of the service does not have.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from converters.errors import ModelReferenceError

#: The file names of a Hugging Face safetensors checkpoint: one file, or shards listed in the index.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"

__all__ = [
    "INDEX_NAME",
    "SINGLE_FILE_NAME","MAX_MODEL_DIRECTORY_ENTRIES", "FileConfinement", "check_model_directory", "copy_model_file"]

#: A model directory holds a config, tokenizer files and shards: tens of files. Ten thousand bounds the walk.
MAX_MODEL_DIRECTORY_ENTRIES = 10_000
#: Hub repositories nest a folder or two (``original/``, ``onnx/``); 32 bounds the walk's recursion.
MAX_MODEL_DIRECTORY_DEPTH = 32


@dataclass(frozen=True)
class FileConfinement:
    """Where a model file may really live.

    Attributes:
        roots: resolved directories model files may resolve into (allowed roots, hub cache, demo directory).
        private: resolved paths refused even below a root (the server's data: database, keys, artifacts).
        exempt: resolved directories inside ``private`` that are model sources all the same (the demo models).
    """

    roots: tuple[Path, ...]
    private: tuple[Path, ...] = ()
    exempt: tuple[Path, ...] = ()

    def allows(self, real: Path) -> bool:
        """Whether the resolved path ``real`` lies below a root and not in a private directory."""
        if any(_below(real, exempt) for exempt in self.exempt):
            return True
        if any(_below(real, private) for private in self.private):
            return False
        return any(_below(real, root) for root in self.roots)


def _below(path: Path, directory: Path) -> bool:
    return path == directory or directory in path.parents


def check_model_directory(directory: Path, confinement: FileConfinement, *, shown: str) -> None:
    """Refuse a model directory any entry of which resolves outside ``confinement``.

    Args:
        directory: the model directory, itself already resolved and allowed.
        confinement: where its files may resolve (``converters.model.sources.confinement_for``).
        shown: how to name the model in a message (the reference the user gave, never a server path).

    Raises:
        ModelReferenceError: naming the first offending file relative to the model directory, or a
            directory with more than :data:`MAX_MODEL_DIRECTORY_ENTRIES` entries.
    """
    for count, _ in enumerate(_entries(Path(directory), confinement, shown), start=1):
        if count > MAX_MODEL_DIRECTORY_ENTRIES:
            raise ModelReferenceError(
                f"model {shown!r} holds more than {MAX_MODEL_DIRECTORY_ENTRIES} files; point at the directory that "
                "holds config.json and the weights, not one above it", field="model")


def _entries(directory: Path, confinement: FileConfinement, shown: str,
             prefix: str = "", seen: frozenset[Path] = frozenset()) -> Iterator[str]:
    """The name of each entry below ``directory``, relative to the model directory; links are checked and
    linked directories walked (once each: a link loop ends the walk of that branch)."""
    try:
        with os.scandir(directory) as scan:
            items = sorted(scan, key=lambda item: item.name)
    except OSError as exc:
        raise ModelReferenceError(f"model {shown!r}: cannot list {prefix or '.'} ({exc.strerror})",
                                  field="model") from exc
    if prefix.count("/") >= MAX_MODEL_DIRECTORY_DEPTH:
        raise ModelReferenceError(f"model {shown!r}: {prefix!r} is nested more than {MAX_MODEL_DIRECTORY_DEPTH} "
                                  "directories deep; a model directory is flat", field="model")
    for item in items:
        name = f"{prefix}{item.name}"
        yield name
        path = Path(item.path)
        if item.is_symlink():
            real = _link_target(path, name, shown)
            if not confinement.allows(real):
                raise ModelReferenceError(
                    f"model {shown!r}: {name!r} is a link to a file outside the directories this server reads "
                    "models from; replace the link with a copy of the file it should be", field="model")
            if real.is_dir() and real not in seen:
                yield from _entries(real, confinement, shown, f"{name}/", seen | {real})
        elif item.is_dir(follow_symlinks=False):
            yield from _entries(path, confinement, shown, f"{name}/", seen)


def _link_target(path: Path, name: str, shown: str) -> Path:
    try:
        return path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # RuntimeError: a link loop on Python < 3.13
        raise ModelReferenceError(
            f"model {shown!r}: {name!r} is a broken or looping link; remove it or replace it with the file",
            field="model") from exc


def copy_model_file(source: Path, destination: Path, confinement: FileConfinement) -> None:
    """Copy ``source`` to ``destination`` (through a temporary name), never reading outside ``confinement``.

    The link chain is resolved and checked first, then the resolved file is opened with ``O_NOFOLLOW``: a link
    put in its place after the check makes the open fail instead of reading elsewhere.

    Raises:
        ModelReferenceError: ``source`` resolves outside the confinement or is not a regular file.
    """
    real = Path(os.path.realpath(source))
    if not confinement.allows(real):
        raise ModelReferenceError(
            f"{source.name!r} is a link to a file outside the directories this server reads models from; "
            "replace the link with a copy of the file", field="model")
    try:
        descriptor = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ModelReferenceError(f"{source.name!r} changed while it was read ({exc.strerror}); try again",
                                  field="model") from exc
    temporary = destination.with_name(f".{destination.name}.tmp")
    with os.fdopen(descriptor, "rb") as reader:
        size = os.fstat(reader.fileno())
        if not stat.S_ISREG(size.st_mode):
            raise ModelReferenceError(f"{source.name!r} is not a regular file; remove it from the model directory",
                                      field="model")
        with open(temporary, "wb") as writer:
            _copy_bytes(reader, writer, size.st_size)
    os.replace(temporary, destination)


def _copy_bytes(reader, writer, size: int) -> None:
    """Copy in the kernel (``sendfile``) where it can; weight shards are gigabytes."""
    offset = 0
    try:
        while offset < size:
            sent = os.sendfile(writer.fileno(), reader.fileno(), offset, min(size - offset, 1 << 30))
            if sent == 0:
                break
            offset += sent
    except OSError as exc:
        if offset or exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    if offset < size:  # no sendfile between these files, or the file grew: copy the rest in user space
        reader.seek(offset)
        writer.seek(offset)
        shutil.copyfileobj(reader, writer, 16 * 1024 * 1024)
