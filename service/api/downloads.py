"""Artifact downloads: one ``Range`` (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``) honoured, ``If-Range`` checked.

Starlette's ``FileResponse`` answers an unsatisfiable or malformed ``Range`` itself, in plain text; parsing the
header here lets those answers go through the one JSON error handler (416 with ``Content-Range: bytes */size``).
The file is opened before the response starts, so a job deleted mid-download still finishes that download.

The bytes go out through ``ReadAheadResponse``: the next piece is read while the last one is sent, and a client
that disconnects stops the reading.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from email.utils import formatdate
from typing import IO
from urllib.parse import quote

from service.api.streaming import ReadAheadResponse
from service.artifacts import ArtifactDirs
from service.errors import ArtifactNotFound, RangeNotSatisfiable
from service.jobs import Job

__all__ = ["parse_range", "artifact_response", "ArtifactResponse"]

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
