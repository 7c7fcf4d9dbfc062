"""Artifact downloads: one ``Range`` (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``) honoured, ``If-Range`` checked.

Starlette's ``FileResponse`` answers an unsatisfiable or malformed ``Range`` itself, in plain text; parsing the
header here lets those answers go through the one JSON error handler (416 with ``Content-Range: bytes */size``).
The file is opened before the response starts, so a job deleted mid-download still finishes that download.

The bytes go out through ``ReadAheadResponse``: the next piece is read while the last one is sent, and a client
that disconnects stops the reading.

``archive_response`` sends every artifact of a job as one tar (``GET /v1/jobs/{id}/archive``), streamed: only the
names the job's listing holds, each resolved as a single download resolves it, under ``<job id>/``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import tarfile
import time
from collections.abc import Callable, Mapping
from email.utils import formatdate
from typing import IO, Any
from urllib.parse import quote

from service.api.streaming import ReadAheadResponse
from service.artifacts import ArtifactDirs
from service.errors import ArtifactNotFound, InvalidTransition, RangeNotSatisfiable
from service.jobs import Job, JobStatus

__all__ = ["parse_range", "artifact_response", "ArtifactResponse", "archive_response", "ArchiveResponse"]

logger = logging.getLogger(__name__)

_RANGE = re.compile(r"bytes=(?:([0-9]{1,19})-([0-9]{0,19})|-([0-9]{1,19}))")


def parse_range(header: str, size: int) -> tuple[int, int]:
    """The inclusive byte span one ``Range`` header asks for in a file of ``size`` bytes.

    Raises:
        RangeNotSatisfiable: several ranges, a malformed one, or one that lies outside the file.
    """
    match = _RANGE.fullmatch(header.strip().replace(" ", ""))
    unsatisfiable = RangeNotSatisfiable(
        f"Range {header!r} cannot be served for this {size}-byte file; send one range such as "
        f"'bytes=0-1023', 'bytes=1024-' or 'bytes=-1024'",
        field="Range", headers={"Content-Range": f"bytes */{size}"},
    )
    if match is None:
        raise unsatisfiable
    first, last, suffix = match.groups()
    if suffix is not None:
        length = int(suffix)
        if length == 0 or size == 0:
            raise unsatisfiable
        return max(0, size - length), size - 1
    start = int(first)
    end = int(last) if last else size - 1
    if start > end or start >= size:
        raise unsatisfiable
    return start, min(end, size - 1)


class ArtifactResponse(ReadAheadResponse):
    """Streams ``length`` bytes of an already open file from ``offset`` (nothing for HEAD), then closes it."""

    def __init__(self, fh: IO[bytes], offset: int, length: int, *, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(length, status_code=status_code, headers=headers)
        self.fh, self.position = fh, offset
        if hasattr(os, "posix_fadvise") and length:  # a larger kernel read-ahead; only advice, a refusal is fine
            with contextlib.suppress(OSError):
                os.posix_fadvise(fh.fileno(), offset, length, os.POSIX_FADV_SEQUENTIAL)

    def read(self, size: int) -> bytes:
        try:
            piece = os.pread(self.fh.fileno(), size, self.position)  # b"": the file shrank under us
        except OSError:
            logger.warning("reading %s failed mid-download; the client gets a short body to resume", self.fh.name,
                           exc_info=True)
            return b""
        self.position += len(piece)
        return piece

    def close(self) -> None:
        self.fh.close()


def artifact_response(
    job: Job, name: str, dirs: ArtifactDirs, *, range_header: str | None, if_range: str | None
) -> ArtifactResponse:
    """The download of one artifact: whole (200) or one byte range (206).

    Raises:
        ArtifactNotFound: no such artifact, or its file vanished (e.g. the job was just deleted).
        RangeNotSatisfiable: a ``Range`` that cannot be served (416).
    """
    path, entry = dirs.resolve(job, name)
    try:
        fh = path.open("rb")
    except FileNotFoundError:
        raise ArtifactNotFound(f"artifact {name!r} of job {job.id} is missing on disk") from None
    try:
        stat = os.fstat(fh.fileno())
        size = stat.st_size
        etag = f'"{entry["sha256"]}"'
        headers = {"etag": etag, "accept-ranges": "bytes", "last-modified": formatdate(stat.st_mtime, usegmt=True),
                   "content-disposition": _disposition(path.name)}
        # If-Range guards a resume: a file that changed since (another ETag) is sent whole
        if range_header is None or (if_range is not None and if_range.strip() != etag):
            return ArtifactResponse(fh, 0, size, status_code=200, headers=headers)
        start, end = parse_range(range_header, size)
        headers["content-range"] = f"bytes {start}-{end}/{size}"
        return ArtifactResponse(fh, start, end - start + 1, status_code=206, headers=headers)
    except BaseException:
        fh.close()
        raise


def _disposition(filename: str) -> str:
    quoted = quote(filename)
    return f"attachment; filename*=utf-8''{quoted}" if quoted != filename else f'attachment; filename="{filename}"'


_BLOCK = 512


class _Member:
    """One file of an archive: its name, tar header and size, and how to read it (opened once the archive is there)."""

    def __init__(self, name: str, header: bytes, size: int, open_source: Callable[[], Any]) -> None:
        self.name, self.header, self.size, self.open_source = name, header, size, open_source


class ArchiveResponse(ReadAheadResponse):
    """Streams a tar of ``members``: each one's header, its bytes and zero padding to a block, then the two zero
    blocks that end a tar. Every size is known beforehand, so is the length; a source that ends early (a file cut
    short under us) gives a short body, never a misaligned archive."""

    media_type = "application/x-tar"

    def __init__(self, members: list[_Member], *, headers: dict[str, str]) -> None:
        length = sum(len(m.header) + m.size + (-m.size) % _BLOCK for m in members) + 2 * _BLOCK
        super().__init__(length, status_code=200, headers={**headers, "content-type": self.media_type})
        self.members, self.index = members, 0
        self.pending = b""  # header, padding or end blocks not sent yet
        self.left = 0  # bytes of the current member's file still to read
        self.source: Any = None
        self.broken = False

    def read(self, size: int) -> bytes:
        pieces: list[bytes] = []
        while size > 0 and not self.broken:
            if self.pending:
                piece, self.pending = self.pending[:size], self.pending[size:]
            elif self.left:
                piece = self._read_file(size)
            elif not self._advance():
                break
            else:
                continue
            pieces.append(piece)
            size -= len(piece)
        return b"".join(pieces)

    def _read_file(self, size: int) -> bytes:
        member = self.members[self.index - 1]
        try:
            if self.source is None:
                self.source = member.open_source()
            piece = self.source.read(min(size, self.left))
        except Exception:  # noqa: BLE001 - the disk or the store failed mid-archive: the 200 has gone out already
            logger.warning("reading %s failed mid-archive", member.name, exc_info=True)
            piece = b""
        if not piece:
            logger.warning("%s ended early in a job's archive; the client gets a short body", member.name)
            self.broken = True
        self.left -= len(piece)
        if not self.left:
            self.pending = b"\0" * ((-member.size) % _BLOCK)
            self._close_source()
        return piece

    def _advance(self) -> bool:
        """Queue the next member's header (or the end blocks); False once everything has been queued."""
        if self.index > len(self.members):
            return False
        if self.index == len(self.members):
            self.pending = b"\0" * (2 * _BLOCK)
        else:
            member = self.members[self.index]
            self.pending, self.left = member.header, member.size
        self.index += 1
        return True

    def _close_source(self) -> None:
        if self.source is not None:
            with contextlib.suppress(Exception):  # a file's or the store's reader: closing must not fail a send
                self.source.close()
            self.source = None

    def close(self) -> None:
        self._close_source()
        for member in self.members:
            getattr(member.open_source, "close", lambda: None)()


class _OpenFile:
    """A file opened when the archive is asked for (a job deleted mid-download still finishes it)."""

    def __init__(self, path: Any) -> None:
        self.fh = path.open("rb")

    def __call__(self) -> IO[bytes]:
        return self.fh

    def close(self) -> None:
        self.fh.close()


def archive_response(job: Job, storage: Any) -> ArchiveResponse:
    """Every artifact of a succeeded job in one tar, ``<job id>/<name>`` each, from the disk or the object store.

    Raises:
        InvalidTransition (409): the job has not succeeded (it has no artifacts yet, or never will).
        ArtifactNotFound (404): a listed file is missing on disk (e.g. the job was just deleted).
    """
    if job.status is not JobStatus.SUCCEEDED:
        raise InvalidTransition(f"job {job.id} is {job.status.value}: its artifacts can be downloaded once it has "
                                "succeeded; follow GET /v1/jobs/{id}/events until then")
    mtime = int(job.finished_at or time.time())
    members: list[_Member] = []
    try:
        for entry in job.artifacts:
            members.append(_Member(entry["name"], _tar_header(job.id, entry, mtime), entry["bytes"],
                                   _source(job, entry, storage)))
    except BaseException:
        for member in members:
            getattr(member.open_source, "close", lambda: None)()
        raise
    return ArchiveResponse(members, headers={"content-disposition": _disposition(f"fp8forge-job-{job.id}.tar")})


def _tar_header(job_id: str, entry: Mapping[str, Any], mtime: int) -> bytes:
    info = tarfile.TarInfo(f"{job_id}/{entry['name']}")
    info.size, info.mtime, info.mode = entry["bytes"], mtime, 0o644
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8")


def _source(job: Job, entry: Mapping[str, Any], storage: Any) -> Callable[[], Any]:
    if not storage.remote:
        path, _ = storage.resolve(job, entry["name"])
        try:
            return _OpenFile(path)
        except FileNotFoundError:
            raise ArtifactNotFound(f"artifact {entry['name']!r} of job {job.id} is missing on disk") from None
    if entry["bytes"] == 0:
        return lambda: None  # nothing to read: never asked for
    return lambda: storage.read(job, entry["name"], 0, entry["bytes"] - 1)[0]
