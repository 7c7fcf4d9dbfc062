"""Artifact downloads from the object store: streamed through the API, or a redirect to a pre-signed URL.

Streamed, a download answers exactly as one from the local disk (``service.api.downloads``): the ``ETag`` is
the quoted sha256 of the listing, one ``Range`` gives 206, ``If-Range`` with another ETag the whole file, and a
``Range`` that cannot be served is 416 before the store is asked. The store is read in 1 MiB pieces as the
client takes them; a client that disconnects closes the store's response.

Redirected (``FP8FORGE_ARTIFACT_DOWNLOADS=redirect``), GET answers 307 with a URL of the store that expires
after ``FP8FORGE_PRESIGNED_URL_TTL_S``; the client sends its ``Range`` there, and the store serves it (its own
ETag, which is not the sha256: the listing keeps that). HEAD is answered here in both modes, since a URL
signed for GET does not admit HEAD.
"""

from __future__ import annotations

import logging
from email.utils import formatdate
from typing import Any

from botocore.exceptions import BotoCoreError
from starlette.responses import RedirectResponse, Response

from service.api.downloads import _disposition, parse_range
from service.api.streaming import ReadAheadResponse
from service.artifacts.base import listed_entry
from service.artifacts.s3 import ObjectArtifacts
from service.jobs import Job

__all__ = ["object_response", "ObjectResponse"]

logger = logging.getLogger(__name__)


class ObjectResponse(ReadAheadResponse):
    """Streams ``length`` bytes of an open object-store body (nothing for HEAD), then closes it."""

    def __init__(self, body: Any, length: int, *, status_code: int, headers: dict[str, str]) -> None:
        super().__init__(length, status_code=status_code, headers=headers)
        self.body_stream = body

    def read(self, size: int) -> bytes:
        try:
            return self.body_stream.read(size)
        except (BotoCoreError, OSError):
            logger.warning("the object store broke off a download; the client gets a short body to resume",
                           exc_info=True)
            return b""

    def close(self) -> None:
        if self.body_stream is not None:
            self.body_stream.close()


def object_response(
    job: Job, name: str, storage: ObjectArtifacts, *, range_header: str | None, if_range: str | None, head: bool,
    redirect: bool,
) -> Response:
    """The download of one artifact from the store: whole (200), one byte range (206), or a redirect (307).

    Raises:
        ArtifactNotFound: no such artifact, or its object is gone (e.g. the job was just deleted).
        RangeNotSatisfiable: a ``Range`` that cannot be served (416).
        ArtifactStoreUnavailable: the store did not answer (503).
    """
    disposition = _disposition(name.rsplit("/", 1)[-1])
    if redirect and not head:
        url = storage.presigned_url(job, name, disposition=disposition)
        return RedirectResponse(url, status_code=307, headers={"cache-control": "no-store"})
    entry = listed_entry(job, name)
    size, etag = entry["bytes"], f'"{entry["sha256"]}"'
    headers = {"etag": etag, "accept-ranges": "bytes", "content-disposition": disposition}
    status, first, last = 200, 0, size - 1
    # If-Range guards a resume: a file that changed since (another ETag) is sent whole
    if range_header is not None and (if_range is None or if_range.strip() == etag):
        first, last = parse_range(range_header, size)  # 416 before the store is asked
        status = 206
        headers["content-range"] = f"bytes {first}-{last}/{size}"
    if head or size == 0:
        body, (_, modified) = None, storage.stat(job, name)
    else:
        body, modified = storage.read(job, name, first, last)
    headers["last-modified"] = formatdate(modified.timestamp(), usegmt=True)
    return ObjectResponse(body, last - first + 1, status_code=status, headers=headers)
