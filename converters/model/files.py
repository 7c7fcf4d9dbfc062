"""Every file a job reads from a model directory stays inside the places models may come from.

A model directory below an allowed root may hold symbolic links; the hub cache is made of them (each
snapshot file links to a blob). A link that leaves those places (``vocab.txt -> <data dir>/api_keys``) would
let one tenant read the server's own files through a conversion and download them as an artifact. So:

- :func:`check_model_directory` resolves every entry of a model directory before anything reads it and
  refuses the first one that resolves outside the allowed roots, the hub cache and the demo directory, or
  into the server's private directories, naming the file;
- every reader of a model file (weights, index, config, tokenizer, side files) opens it with
  :func:`open_model_file`, which follows no link after its check: the path is resolved once, the resolved
  path checked against the confinement, and then opened one component at a time from the allowed root that
  holds it, each directory relative to the one before with ``O_DIRECTORY | O_NOFOLLOW`` and the file with
  ``O_NOFOLLOW``; what was opened must be the regular file that was checked (same ``st_dev``/``st_ino``).
  A tenant who swaps a directory of the resolved path for a link while a job reads (``renameat2`` with
  ``RENAME_EXCHANGE`` in a loop) makes the open fail; it can never make it read through the link.
  ``O_NOFOLLOW`` on the resolved path alone guards only its last component, which that swap goes around.

Libraries that want a path get one that cannot be redirected: ``/proc/self/fd/<fd>`` of the opened file
(:func:`pinned_model_path`, for ``safe_open``), or a private (0700) staging directory
(:func:`staged_model_directory`, for transformers' ``from_pretrained``) holding copies of the small files
(config, tokenizer, index) and, for weights, links to the opened files' ``/proc/self/fd`` entries: weights are
never copied, and the links resolve only in this process.

The confinement a reader checks against is the one it is given; a reader that is given none (the weight and
index readers deep in the pipeline take a path only) uses the one :func:`check_model_directory` last checked
the model directory holding the file against in this process (every job checks its model directory before it
reads it), and for a file in no checked directory, the file's own directory: no link out of it is followed.

Hard links cannot be told from the original file and are not checked: making one needs write access to
the target's own file system, which a tenant of the service does not have.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from converters.errors import ModelReferenceError

#: The file names of a Hugging Face safetensors checkpoint: one file, or shards listed in the index.
INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"

__all__ = [
    "INDEX_NAME",
    "SINGLE_FILE_NAME",
    "MAX_MODEL_DIRECTORY_ENTRIES",
    "MAX_STAGED_FILE_BYTES",
    "FileConfinement",
    "check_model_directory",
    "open_model_file",
    "model_file_reader",
    "read_model_text",
    "pinned_model_path",
    "staged_model_directory",
    "copy_model_file",
    "is_plain_file_name",
]

#: A model directory holds a config, tokenizer files and shards: tens of files. Ten thousand bounds the walk.
MAX_MODEL_DIRECTORY_ENTRIES = 10_000
#: Hub repositories nest a folder or two (``original/``, ``onnx/``); 32 bounds the walk's recursion.
MAX_MODEL_DIRECTORY_DEPTH = 32


def is_plain_file_name(name: object) -> bool:
    """Whether ``name`` (read from a payload or a record) names a file in one directory, not a path elsewhere."""
    return isinstance(name, str) and bool(name) and Path(name).name == name and name not in (".", "..")


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

    def root_of(self, real: Path) -> Path:
        """The deepest root or exempt directory holding the allowed resolved path ``real``."""
        return max((place for place in (*self.exempt, *self.roots) if _below(real, place)),
                   key=lambda place: len(place.parts))


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
    _remember(Path(directory), confinement)


#: model directories checked in this process -> the confinement each was checked against, for the readers that
#: are handed a path only (:func:`open_model_file`); the newest few hundred, so a long-lived API process stays small
_CHECKED: dict[Path, FileConfinement] = {}
_CHECKED_KEPT = 256


def _remember(directory: Path, confinement: FileConfinement) -> None:
    for key in {Path(os.path.abspath(directory)), Path(os.path.realpath(directory))}:
        _CHECKED.pop(key, None)
        _CHECKED[key] = confinement
    while len(_CHECKED) > _CHECKED_KEPT:
        _CHECKED.pop(next(iter(_CHECKED)), None)


def _confinement_of(path: Path) -> FileConfinement:
    """The confinement of the checked model directory holding ``path``; else ``path``'s own directory."""
    for candidate in (Path(os.path.abspath(path)), Path(os.path.realpath(path.parent)) / path.name):
        for directory in candidate.parents:
            found = _CHECKED.get(directory)
            if found is not None:
                return found
    return FileConfinement(roots=(Path(os.path.realpath(path.parent)),))


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


#: no link is followed while a file is opened; the file itself must not block (a FIFO) or be a terminal
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_FILE_FLAGS = (os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
               | getattr(os, "O_CLOEXEC", 0))
#: what the walk meets when a directory of the checked path was swapped for a link or moved away meanwhile
_SWAPPED = (errno.ELOOP, errno.ENOTDIR, errno.ENOENT, errno.EMLINK)


def open_model_file(path: Path, confinement: FileConfinement | None = None) -> int:
    """A read-only descriptor of the regular file ``path`` resolves to, opened without following any link
    after the resolved path was checked against ``confinement`` (see the module docstring); the caller closes it.

    Args:
        path: a model file, often a link (the hub cache's into its blobs).
        confinement: where it may resolve; None: the one its model directory was checked against in this
            process (:func:`check_model_directory`), else its own directory.

    Raises:
        ModelReferenceError: ``path`` resolves outside the confinement, is not a regular file, or changed
            while it was opened (a directory on its way swapped for a link).
        OSError: it does not exist or cannot be read (as ``open`` raises them).
    """
    path = Path(path)
    confinement = confinement if confinement is not None else _confinement_of(path)
    try:
        real = Path(os.path.realpath(path))
    except OSError as exc:  # EINVAL: a link seen by lstat was a directory again when read (the swap under way)
        if exc.errno != errno.EINVAL:
            raise
        raise _changed(path, exc.strerror) from exc
    if not confinement.allows(real):
        raise ModelReferenceError(
            f"{path.name!r} is a link to a file outside the directories this server reads models from; "
            "replace the link with a copy of the file", field="model")
    checked = os.stat(real, follow_symlinks=False)
    if not stat.S_ISREG(checked.st_mode):
        raise _not_regular(path)
    try:
        descriptor = _open_beneath(confinement.root_of(real), real)
    except OSError as exc:
        if exc.errno not in _SWAPPED:
            raise
        raise _changed(path, exc.strerror) from exc
    opened = os.fstat(descriptor)
    if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (checked.st_dev, checked.st_ino):
        os.close(descriptor)
        raise _changed(path, "another file was found in its place")
    os.set_blocking(descriptor, True)
    return descriptor


def _open_beneath(root: Path, real: Path) -> int:
    """Open ``real`` one component at a time from ``root``, following no link on the way."""
    parts = real.relative_to(root).parts
    if not parts:
        return os.open(real, _FILE_FLAGS)
    directory = os.open(root, _DIRECTORY_FLAGS)
    try:
        for part in parts[:-1]:
            inner = os.open(part, _DIRECTORY_FLAGS, dir_fd=directory)
            os.close(directory)
            directory = inner
        return os.open(parts[-1], _FILE_FLAGS, dir_fd=directory)
    finally:
        os.close(directory)


def _changed(path: Path, why: str) -> ModelReferenceError:
    return ModelReferenceError(f"{path.name!r} changed while it was read ({why}); a directory on its way was "
                               "replaced by a link or moved. Leave the model directory unchanged while the job "
                               "runs and try again", field="model")


def _not_regular(path: Path) -> ModelReferenceError:
    return ModelReferenceError(f"{path.name!r} is not a regular file; remove it from the model directory",
                               field="model")


def model_file_reader(path: Path, confinement: FileConfinement | None = None) -> BinaryIO:
    """:func:`open_model_file` as a binary file object (``with model_file_reader(path) as handle:``)."""
    return os.fdopen(open_model_file(path, confinement), "rb")


def read_model_text(path: Path, confinement: FileConfinement | None = None) -> str:
    """A small model file (config, index) read whole through :func:`open_model_file`, as UTF-8 text."""
    with model_file_reader(path, confinement) as handle:
        return handle.read().decode("utf-8")


@contextmanager
def pinned_model_path(path: Path, confinement: FileConfinement | None = None) -> Iterator[str]:
    """A path naming the file :func:`open_model_file` opened, for a library that opens by path (``safe_open``):
    ``/proc/self/fd/<fd>``, valid in this process only, until the ``with`` block ends."""
    descriptor = open_model_file(path, confinement)
    try:
        yield f"{_FD_DIRECTORY}/{descriptor}"
    finally:
        os.close(descriptor)


_FD_DIRECTORY = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
#: a staged copy is a config, a tokenizer or an index: the largest tokenizers are tens of MiB
MAX_STAGED_FILE_BYTES = 512 * 2**20


@contextmanager
def staged_model_directory(directory: Path, confinement: FileConfinement | None = None, *,
                           copies: Iterable[str], links: Iterable[str] = ()) -> Iterator[Path]:
    """A private (0700) directory for transformers' ``from_pretrained``, holding what it reads of ``directory``
    and nothing it could be redirected through, until the ``with`` block ends.

    Args:
        directory: the model directory.
        confinement: as for :func:`open_model_file`.
        copies: names of small files (config, tokenizer, index), copied through :func:`open_model_file`;
            those ``directory`` has no entry for are left out.
        links: names of weight files, opened through :func:`open_model_file` and linked as their
            ``/proc/self/fd`` entries: never copied, and readable only by this process while the block runs.

    The staging directory is named like ``directory`` (transformers names a model's remote-code module after it).

    Raises:
        ModelReferenceError, OSError: as :func:`open_model_file`; also a copy over :data:`MAX_STAGED_FILE_BYTES`.
    """
    directory = Path(directory)
    with tempfile.TemporaryDirectory(prefix="fp8forge-model-") as private, ExitStack() as pinned:
        staged = Path(private) / (directory.name or "model")
        staged.mkdir(mode=0o700)
        for name in dict.fromkeys(copies):
            if os.path.lexists(directory / name):  # the entry itself: a swap under way must fail, not skip it
                _stage_copy(directory / name, staged / name, confinement)
        for name in dict.fromkeys(links):
            (staged / name).symlink_to(pinned.enter_context(pinned_model_path(directory / name, confinement)))
        yield staged


def _stage_copy(source: Path, destination: Path, confinement: FileConfinement | None) -> None:
    with model_file_reader(source, confinement) as reader:
        data = reader.read(MAX_STAGED_FILE_BYTES + 1)
    if len(data) > MAX_STAGED_FILE_BYTES:
        raise ModelReferenceError(f"{source.name!r} is larger than {MAX_STAGED_FILE_BYTES >> 20} MiB, more than a "
                                  "config or tokenizer file holds; remove it from the model directory", field="model")
    destination.write_bytes(data)


def copy_model_file(source: Path, destination: Path, confinement: FileConfinement) -> None:
    """Copy ``source`` to ``destination`` (through a temporary name), never reading outside ``confinement``.

    The file is opened with :func:`open_model_file`: no link is followed after the check, so a link (or a
    directory swapped for one) put in its way after the check makes the copy fail instead of reading elsewhere.

    Raises:
        ModelReferenceError: ``source`` resolves outside the confinement, is not a regular file or changed
            while it was opened.
    """
    temporary = destination.with_name(f".{destination.name}.tmp")
    with model_file_reader(source, confinement) as reader, open(temporary, "wb") as writer:
        _copy_bytes(reader, writer, os.fstat(reader.fileno()).st_size)
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
