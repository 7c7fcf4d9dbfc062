"""Artifact downloads: one ``Range`` (``bytes=a-b``, ``bytes=a-``, ``bytes=-n``) honoured, ``If-Range`` checked.

Starlette's ``FileResponse`` answers an unsatisfiable or malformed ``Range`` itself, in plain text; parsing the
header here lets those answers go through the one JSON error handler (416 with ``Content-Range: bytes */size``).
The file is opened before the response starts, so a job deleted mid-download still finishes that download.

A client that disconnects stops the reading (the server would otherwise read the rest of the file for nobody).
"""

from __future__ import annotations

import contextlib
import os
import re
from email.utils import formatdate
from typing import IO
from urllib.parse import quote

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.artifacts import ArtifactDirs
from service.errors import ArtifactNotFound, RangeNotSatisfiable
from service.jobs import Job

__all__ = ["parse_range", "artifact_response", "ArtifactResponse"]

# Uvicorn offers ASGI no zero-copy send, so every byte is read and written once more in this process; with 1 MiB
# reads a download still runs at what TCP on loopback carries (benchmarks/bench_api.py: about 0.9 of a bare
# socket sending from memory); larger reads bought nothing there and cost memory per download.
_CHUNK = 1 << 20
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


class ArtifactResponse(Response):
    """Streams ``length`` bytes of an already open file from ``offset`` (nothing for HEAD), then closes it."""

    def __init__(self, fh: IO[bytes], offset: int, length: int, *, status_code: int, headers: dict[str, str]) -> None:
        self.fh, self.offset, self.length = fh, offset, length
        self.status_code = status_code
        self.media_type = "application/octet-stream"
        self.background = None
        self.init_headers({**headers, "content-length": str(length)})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if scope.get("method") == "HEAD" or self.length == 0:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_cancel_on_disconnect, receive, tasks.cancel_scope)
                await self._send_body(send)
                tasks.cancel_scope.cancel()
        finally:
            self.fh.close()  # no read is running: a cancelled read finishes in its thread before this

    async def _send_body(self, send: Send) -> None:
        fd, position, left = self.fh.fileno(), self.offset, self.length
        if hasattr(os, "posix_fadvise"):  # a larger kernel read-ahead; only advice, so a refusal is fine
            with contextlib.suppress(OSError):
                os.posix_fadvise(fd, position, left, os.POSIX_FADV_SEQUENTIAL)
        while left > 0:
            chunk = await anyio.to_thread.run_sync(os.pread, fd, min(_CHUNK, left), position)
            if not chunk:  # the file shrank under us; the client sees a short body, never wrong bytes
                break
            position, left = position + len(chunk), left - len(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": left > 0})
        if left > 0:
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


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
