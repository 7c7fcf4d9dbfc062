"""One file into an S3-compatible store: multipart with bounded memory, every byte checked against its sha256.

Three checks, each catching what the others cannot:

1. Each part travels with its own SHA-256 (``x-amz-checksum-sha256``); the store recomputes it and refuses a
   part damaged on the way (AWS S3 and most compatible stores do; a store that ignores the header is caught
   by check 3).
2. The worker hashes exactly the bytes it sends, in order, and compares the whole-file digest with the sha256
   recorded in the job's listing before completing the upload: a file that changed on disk after it was
   indexed (or a bad read) aborts the upload instead of publishing bytes the listing does not describe.
3. Once complete, the object's size and the checksum the store computed (HEAD with checksum mode: the
   SHA-256 of a single PUT, or for a multipart object the SHA-256 of the part digests) are compared with what
   was sent. A store that keeps no checksum is checked by size only.

Memory: at most ``concurrency`` parts are in flight and one more is being read, so a worker holds about
``(concurrency + 1) * part_size`` bytes whatever the file's size.
"""

from __future__ import annotations

import base64
import hashlib
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from service.artifacts.base import ArtifactUploadFailed

__all__ = ["put_file", "MAX_PARTS"]

logger = logging.getLogger(__name__)

MAX_PARTS = 10_000  # S3's limit on parts per upload
_MiB = 1 << 20


def _b64(digest: bytes) -> str:
    return base64.b64encode(digest).decode()


def put_file(
    client: Any, bucket: str, key: str, path: Path, *, name: str, size: int, sha256: str, part_size: int,
    concurrency: int, should_stop: Callable[[], bool],
) -> None:
    """Upload ``path`` to ``key`` unless an identical object is there already (a retried attempt).

    Raises:
        ArtifactUploadFailed: the store refused or did not answer, the file differs from its recorded
            ``sha256``, the stored object differs from what was sent, or ``should_stop()`` turned true.
    """
    try:
        if _already_there(client, bucket, key, size, sha256):
            return
        if size <= part_size:
            expected = _put_single(client, bucket, key, path, name=name, sha256=sha256)
        else:
            expected = _put_multipart(client, bucket, key, path, name=name, size=size, sha256=sha256,
                                      part_size=part_size, concurrency=concurrency, should_stop=should_stop)
        _check_stored(client, bucket, key, name=name, size=size, checksum=expected)
    except (BotoCoreError, ClientError) as exc:
        raise ArtifactUploadFailed(f"the object store refused or did not answer the upload of {name!r}") from exc
    except OSError as exc:
        raise ArtifactUploadFailed(f"{name!r} could not be read from the worker's disk for the upload") from exc


def _already_there(client: Any, bucket: str, key: str, size: int, sha256: str) -> bool:
    try:
        head = client.head_object(Bucket=bucket, Key=key)
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return False
        raise
    return head.get("ContentLength") == size and head.get("Metadata", {}).get("sha256") == sha256


def _put_single(client: Any, bucket: str, key: str, path: Path, *, name: str, sha256: str) -> str:
    data = path.read_bytes()
    digest = hashlib.sha256(data).digest()
    if digest.hex() != sha256:
        raise ArtifactUploadFailed(f"{name!r} does not match the sha256 recorded for it (it changed on the "
                                   "worker's disk after it was listed); nothing was published")
    client.put_object(Bucket=bucket, Key=key, Body=data, ChecksumSHA256=_b64(digest), Metadata={"sha256": sha256},
                      ContentType="application/octet-stream")
    return _b64(digest)


def _put_multipart(
    client: Any, bucket: str, key: str, path: Path, *, name: str, size: int, sha256: str, part_size: int,
    concurrency: int, should_stop: Callable[[], bool],
) -> str:
    fewest = -(-size // MAX_PARTS)  # a part size that keeps the file within S3's part limit
    part_size = max(part_size, -(-fewest // _MiB) * _MiB)
    upload_id = client.create_multipart_upload(
        Bucket=bucket, Key=key, ChecksumAlgorithm="SHA256", Metadata={"sha256": sha256},
        ContentType="application/octet-stream")["UploadId"]
    try:
        parts, whole = _send_parts(client, bucket, key, upload_id, path, part_size, concurrency, should_stop, name)
        if whole != sha256:
            raise ArtifactUploadFailed(f"{name!r} does not match the sha256 recorded for it (it changed on the "
                                       "worker's disk after it was listed); nothing was published")
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": [
            {"PartNumber": n, "ETag": etag, "ChecksumSHA256": _b64(digest)} for n, etag, digest in parts]})
    except BaseException:
        try:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        except (BotoCoreError, ClientError) as exc:  # the store is away: the sweeper aborts it later
            logger.warning("could not abort the multipart upload of %s (%s); the sweeper will", key, exc)
        raise
    return _b64(hashlib.sha256(b"".join(digest for _, _, digest in parts)).digest())


def _send_parts(
    client: Any, bucket: str, key: str, upload_id: str, path: Path, part_size: int, concurrency: int,
    should_stop: Callable[[], bool], name: str,
) -> tuple[list[tuple[int, str, bytes]], str]:
    """Read the file part by part (hashing it whole, in order) while up to ``concurrency`` parts upload."""
    whole = hashlib.sha256()
    done: list[tuple[int, str, bytes]] = []
    in_flight: deque[Future[tuple[int, str, bytes]]] = deque()

    def send(number: int, chunk: bytes) -> tuple[int, str, bytes]:
        digest = hashlib.sha256(chunk).digest()
        answer = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=chunk,
                                    ChecksumSHA256=_b64(digest))
        return number, answer["ETag"], digest

    with ThreadPoolExecutor(concurrency, thread_name_prefix="fp8forge-upload") as pool, path.open("rb") as fh:
        try:
            number = 1
            while chunk := fh.read(part_size):
                if should_stop():
                    raise ArtifactUploadFailed(f"the upload of {name!r} was stopped: the job was cancelled or "
                                               "taken from this worker")
                whole.update(chunk)
                in_flight.append(pool.submit(send, number, chunk))
                number += 1
                del chunk  # the future holds the part until it is sent; nothing else may
                while len(in_flight) >= concurrency:
                    done.append(in_flight.popleft().result())
            while in_flight:
                done.append(in_flight.popleft().result())
        finally:
            for future in in_flight:
                future.cancel()
    return done, whole.hexdigest()


def _check_stored(client: Any, bucket: str, key: str, *, name: str, size: int, checksum: str) -> None:
    head = client.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
    stored = head.get("ChecksumSHA256")
    if head.get("ContentLength") != size or (stored is not None and stored.split("-")[0] != checksum):
        raise ArtifactUploadFailed(f"the object store holds another {name!r} than the one sent (size or "
                                   "checksum differ); nothing was published")
    if stored is None:
        logger.debug("%s: the store keeps no SHA-256 checksum; checked by size only", key)
