"""Artifacts in an S3-compatible object store (boto3), published by the job's row, not by moving objects.

Layout: ``<prefix>jobs/<job_id>/a<attempt>/<name>``. A worker converts into its local scratch directory (an
``ArtifactDirs`` under its own data dir), uploads every file under its attempt's prefix (``s3_upload``), and
then records ``succeeded`` in one transaction that first lists the prefix and checks it holds exactly the
listed files. The committed row (status ``succeeded``, ``attempt`` N) is what publishes ``a<N>/``: readers
resolve a name through the row only, so objects under any other attempt's prefix are never served, and no
object is copied or renamed. Prefixes no row points at are removed by the attempt's own outcome, by the next
attempt of the job, by DELETE and by the sweeper (``service.workers.reaper``).

Credentials come from boto3's usual chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
``AWS_PROFILE``, an instance or task role); retries follow ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS``.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from botocore.exceptions import BotoCoreError, ClientError

from service.artifacts.base import ArtifactStoreUnavailable, ArtifactUploadFailed, Leftover, listed_entry
from service.artifacts.local import ArtifactDirs
from service.artifacts.s3_upload import put_file
from service.errors import ArtifactNotFound
from service.jobs import Job

if TYPE_CHECKING:
    from service.config import Settings

__all__ = ["ObjectArtifacts", "make_client"]

logger = logging.getLogger(__name__)

_MISSING = ("404", "NoSuchKey", "NotFound")
_DELETE_BATCH = 1000  # DeleteObjects takes at most this many keys


def make_client(settings: Settings) -> Any:
    """A boto3 S3 client for the settings' endpoint and region (credentials from the environment)."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    config = Config(
        signature_version="s3v4", connect_timeout=10, read_timeout=60,
        max_pool_connections=max(10, 2 * settings.s3_upload_concurrency),
        # botocore's newer default adds CRC32 checksums to every request, which some S3-compatible stores
        # refuse; fp8forge sends its own SHA-256 checksums where it wants them checked (s3_upload)
        request_checksum_calculation="when_required", response_checksum_validation="when_required",
    )
    return session.client("s3", endpoint_url=settings.s3_endpoint_url or None, config=config,
                          region_name=settings.s3_region or session.region_name or "us-east-1")


class ObjectArtifacts:
    """An ``ArtifactStorage`` in a bucket: uploads under attempt prefixes, the job's row publishes one."""

    remote = True

    def __init__(
        self, client: Any, bucket: str, prefix: str, scratch: ArtifactDirs, *, part_size: int = 16 << 20,
        concurrency: int = 4, presign_ttl_s: int = 900,
    ) -> None:
        self.client, self.bucket, self.prefix, self.scratch = client, bucket, prefix, scratch
        self.part_size, self.concurrency, self.presign_ttl_s = part_size, concurrency, presign_ttl_s
        self._key = re.compile(rf"{re.escape(prefix)}jobs/([0-9a-f]{{32}})/a([0-9]+)/")

    @classmethod
    def from_settings(cls, settings: Settings) -> ObjectArtifacts:
        return cls(make_client(settings), settings.s3_bucket, settings.s3_prefix, ArtifactDirs(settings.jobs_dir),
                   part_size=settings.s3_part_size_bytes, concurrency=settings.s3_upload_concurrency,
                   presign_ttl_s=settings.presigned_url_ttl_s)

    def __repr__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}"

    # -- layout ------------------------------------------------------------------------------------
    def job_prefix(self, job_id: str) -> str:
        return f"{self.prefix}jobs/{job_id}/"

    def attempt_prefix(self, job_id: str, attempt: int) -> str:
        return f"{self.job_prefix(job_id)}a{attempt}/"

    def key(self, job: Job, name: str) -> str:
        """The object behind a published artifact: the prefix of the attempt the job's row names."""
        return self.attempt_prefix(job.id, job.attempt) + name

    # -- the worker's side -------------------------------------------------------------------------
    def ensure(self) -> None:
        self.scratch.ensure()

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
        except (BotoCoreError, ClientError) as exc:
            raise ArtifactStoreUnavailable(f"the artifact bucket {self} cannot be reached: {exc}") from exc

    def attempt_dir(self, job_id: str, attempt: int) -> Path:
        return self.scratch.attempt_dir(job_id, attempt)

    def staging_dir(self, job_id: str, attempt: int) -> Path:
        return self.scratch.staging_dir(job_id, attempt)

    def index(
        self, job_id: str, manifest: Iterable[Mapping[str, Any]] = (), *, attempt: int | None = None
    ) -> list[dict[str, Any]]:
        return self.scratch.index(job_id, manifest, attempt=attempt)

    def upload(self, job_id: str, attempt: int, artifacts: list[dict[str, Any]], *,
               should_stop: Callable[[], bool] = lambda: False) -> None:
        """Upload every listed file of the attempt's scratch directory under its attempt prefix.

        Raises:
            ArtifactUploadFailed: see ``s3_upload.put_file``.
        """
        source, prefix = self.scratch.attempt_dir(job_id, attempt), self.attempt_prefix(job_id, attempt)
        for entry in artifacts:
            put_file(self.client, self.bucket, prefix + entry["name"], source / entry["name"], name=entry["name"],
                     size=entry["bytes"], sha256=entry["sha256"], part_size=self.part_size,
                     concurrency=self.concurrency, should_stop=should_stop)

    def publish(self, job_id: str, attempt: int, artifacts: Iterable[Mapping[str, Any]] = ()) -> None:
        """Check the attempt's prefix holds exactly the listed files (inside the success transaction).

        Raises:
            ArtifactUploadFailed: an object is missing, of another size or unlisted, or the store did not answer.
        """
        wanted = {a["name"]: a["bytes"] for a in artifacts}
        prefix = self.attempt_prefix(job_id, attempt)
        try:
            held = {obj["Key"][len(prefix):]: obj["Size"] for obj in self._objects(prefix)}
        except (BotoCoreError, ClientError) as exc:
            raise ArtifactUploadFailed("the object store did not answer when the upload was to be published") from exc
        if held != wanted:
            raise ArtifactUploadFailed("the object store does not hold exactly the attempt's files; nothing was "
                                       "published")

    def abort_uploads(self, job_id: str, attempt: int) -> None:
        """Abort the attempt's unfinished multipart uploads: a split job's shard writer killed in the middle of
        one leaves it under the prefix its finish task publishes (its retry put the whole object since)."""
        prefix = self.attempt_prefix(job_id, attempt)
        try:
            for page in self._pages("list_multipart_uploads", Prefix=prefix):
                for upload in page.get("Uploads", ()):
                    self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                       UploadId=upload["UploadId"])
        except (BotoCoreError, ClientError):
            logger.warning("job %s: could not abort the unfinished uploads of attempt %d; the sweeper removes them "
                           "once the job has finished", job_id, attempt, exc_info=True)

    def unpublish(self, job_id: str, attempt: int) -> None:
        """Nothing to undo: an uncommitted row never pointed at the prefix."""

    def is_published(self, job_id: str, attempt: int) -> bool:
        return True  # the recorded success checked the objects in its own transaction

    def settle(self, job_id: str, attempt: int) -> None:
        self.scratch.remove_attempt(job_id, attempt)

    def remove_attempt(self, job_id: str, attempt: int) -> None:
        self.scratch.remove_attempt(job_id, attempt)
        self._delete(job_id, lambda n: n == attempt)

    def remove(self, job_id: str, *, below_attempt: int | None = None) -> None:
        """Remove the job's objects and unfinished uploads (only older attempts' with ``below_attempt``).

        A store that does not answer is logged, not raised: the sweeper removes what is left once no row
        points at it.
        """
        self.scratch.remove(job_id, below_attempt=below_attempt)
        self._delete(job_id, lambda n: below_attempt is None or n < below_attempt)

    def leftovers(self) -> Iterator[Leftover]:
        """Local scratch directories, then every attempt prefix with objects or an unfinished upload."""
        yield from self.scratch.leftovers()
        found: set[tuple[str, int]] = set()
        jobs = f"{self.prefix}jobs/"
        for page in self._pages("list_objects_v2", Prefix=jobs, Delimiter="/"):
            for job in page.get("CommonPrefixes", ()):
                for inner in self._pages("list_objects_v2", Prefix=job["Prefix"], Delimiter="/"):
                    found.update(self._parse(p["Prefix"]) for p in inner.get("CommonPrefixes", ()))
        for page in self._pages("list_multipart_uploads", Prefix=jobs):
            found.update(self._parse(u["Key"]) for u in page.get("Uploads", ()))
        for job_id, attempt in sorted(f for f in found if f is not None):
            yield Leftover(job_id, attempt, publishable=True)

    def discard(self, leftover: Leftover) -> None:
        if leftover.publishable:
            self._delete(leftover.job_id, lambda n: n == leftover.attempt)
        else:
            self.scratch.discard(leftover)

    # -- the reader's side -------------------------------------------------------------------------
    def stat(self, job: Job, name: str) -> tuple[Mapping[str, Any], datetime]:
        """The listing entry of a published artifact and its object's last modification.

        Raises:
            ArtifactNotFound; ArtifactStoreUnavailable.
        """
        entry = listed_entry(job, name)
        with self._reading(job, name):
            head = self.client.head_object(Bucket=self.bucket, Key=self.key(job, name))
        return entry, head["LastModified"]

    def read(self, job: Job, name: str, first: int, last: int) -> tuple[Any, datetime]:
        """An open body of bytes ``first..last`` (inclusive) of a published artifact, and its modification time.

        Raises:
            ArtifactNotFound; ArtifactStoreUnavailable.
        """
        listed_entry(job, name)
        with self._reading(job, name):
            got = self.client.get_object(Bucket=self.bucket, Key=self.key(job, name), Range=f"bytes={first}-{last}")
        return got["Body"], got["LastModified"]

    def presigned_url(self, job: Job, name: str, *, disposition: str) -> str:
        """A URL that lets anyone holding it GET the artifact from the store for ``presign_ttl_s`` seconds."""
        listed_entry(job, name)
        return self.client.generate_presigned_url(
            "get_object", ExpiresIn=self.presign_ttl_s,
            Params={"Bucket": self.bucket, "Key": self.key(job, name), "ResponseContentDisposition": disposition})

    # -- helpers -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _reading(self, job: Job, name: str) -> Iterator[None]:
        try:
            yield
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in _MISSING:
                raise ArtifactNotFound(f"artifact {name!r} of job {job.id} is missing in the store") from None
            raise self._unavailable(exc) from exc
        except BotoCoreError as exc:
            raise self._unavailable(exc) from exc

    @staticmethod
    def _unavailable(exc: Exception) -> ArtifactStoreUnavailable:
        logger.error("the artifact store failed a read: %s", exc)
        return ArtifactStoreUnavailable("the artifact store did not answer; try again shortly",
                                        headers={"Retry-After": "5"})

    def _parse(self, key: str) -> tuple[str, int] | None:
        match = self._key.match(key)
        return (match.group(1), int(match.group(2))) if match else None

    def _pages(self, operation: str, **kwargs: Any) -> Iterator[dict[str, Any]]:
        yield from self.client.get_paginator(operation).paginate(Bucket=self.bucket, **kwargs)

    def _objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        for page in self._pages("list_objects_v2", Prefix=prefix):
            yield from page.get("Contents", ())

    def _delete(self, job_id: str, attempts: Callable[[int], bool]) -> None:
        """Delete the job's objects and abort its unfinished uploads whose attempt ``attempts`` selects."""
        def selected(key: str) -> bool:
            parsed = self._parse(key)
            return parsed is not None and attempts(parsed[1])

        prefix = self.job_prefix(job_id)
        try:
            keys = [obj["Key"] for obj in self._objects(prefix) if selected(obj["Key"])]
            for start in range(0, len(keys), _DELETE_BATCH):
                batch = [{"Key": key} for key in keys[start:start + _DELETE_BATCH]]
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            for page in self._pages("list_multipart_uploads", Prefix=prefix):
                for upload in page.get("Uploads", ()):
                    if selected(upload["Key"]):
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                           UploadId=upload["UploadId"])
        except (BotoCoreError, ClientError):
            logger.warning("job %s: could not remove its objects from %s; the sweeper removes them later", job_id,
                           self, exc_info=True)
