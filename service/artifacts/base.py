"""The artifact storage interface: what workers, the API and the sweeper ask of wherever job files live.

A conversion attempt always writes to a local directory first (the pipeline's ``out_dir``). What happens next
depends on the storage: the local one publishes that directory by renaming it, the object store uploads it
under the attempt's own prefix. Either way a job's files become visible only through the transaction that
records ``succeeded``, so a reader never sees a partial or superseded attempt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

from service.errors import ArtifactNotFound, ServiceError
from service.jobs import Job, JobStatus

__all__ = ["ArtifactStorage", "ArtifactUploadFailed", "ArtifactStoreUnavailable", "Leftover", "listed_entry"]


class ArtifactUploadFailed(Exception):
    """An attempt's files could not be put into the store (or were not all there when it was to be published).

    The message names the artifact and what went wrong, never hosts or credentials: it reaches the client as
    the job's ``error.message`` (code ``artifact_upload_failed``). The cause is chained for the worker's log.
    """


class ArtifactStoreUnavailable(ServiceError):
    """The object store did not answer a download (503); the job and its listing are intact."""

    code = "artifact_store_unavailable"
    status_code = 503


class Leftover(NamedTuple):
    """Files of one attempt the storage holds: a local directory, or a prefix (objects, unfinished uploads).

    ``publishable``: this location is what readers get once the job succeeds with this attempt (an object
    prefix); a local attempt directory never is (publishing renames it away, or uploads it).
    """

    job_id: str
    attempt: int
    publishable: bool


class ArtifactStorage(Protocol):
    """Where a job's files live, from the attempt a worker writes to the files a reader downloads.

    Workers call, in this order: :meth:`remove` (older attempts' leftovers) -> the pipeline writes
    :meth:`attempt_dir` -> :meth:`index` -> :meth:`upload` -> :meth:`publish` inside the transaction that
    records the success -> :meth:`settle`. Any other outcome calls :meth:`remove_attempt`.
    """

    #: True when publishing sends files elsewhere (the worker heartbeats while :meth:`upload` runs).
    remote: bool

    def ensure(self) -> None:
        """Create the local directories (and nothing remote)."""

    def check(self) -> None:
        """Raise ``ArtifactStoreUnavailable`` when the storage cannot be reached (a start-up check)."""

    def attempt_dir(self, job_id: str, attempt: int) -> Path:
        """The local directory one attempt's pipeline run writes its finished files to."""

    def staging_dir(self, job_id: str, attempt: int) -> Path:
        """Where the pipeline stages that attempt before renaming it to :meth:`attempt_dir`."""

    def index(
        self, job_id: str, manifest: Iterable[Mapping[str, Any]] = (), *, attempt: int | None = None
    ) -> list[dict[str, Any]]:
        """The listing (name, bytes, sha256) of an attempt's local files."""

    def upload(self, job_id: str, attempt: int, artifacts: list[dict[str, Any]], *,
               should_stop: Callable[[], bool] = lambda: False) -> None:
        """Put the attempt's files where readers will get them once published; raises ``ArtifactUploadFailed``."""

    def publish(self, job_id: str, attempt: int, artifacts: Iterable[Mapping[str, Any]] = ()) -> None:
        """Make the attempt the job's files; runs inside the success transaction (raising there records nothing)."""

    def unpublish(self, job_id: str, attempt: int) -> None:
        """Undo :meth:`publish` after the success could not be recorded."""

    def is_published(self, job_id: str, attempt: int) -> bool:
        """Whether :meth:`publish` has taken effect for this attempt."""

    def settle(self, job_id: str, attempt: int) -> None:
        """After the success was recorded: drop what only served the attempt (a local copy of uploaded files)."""

    def remove_attempt(self, job_id: str, attempt: int) -> None:
        """Remove everything one attempt left, never the published files."""

    def remove(self, job_id: str, *, below_attempt: int | None = None) -> None:
        """Remove a job's files, or (``below_attempt``) only those of older attempts."""

    def leftovers(self) -> Iterator[Leftover]:
        """Every attempt location the storage holds, for the sweeper to judge against the job store."""

    def discard(self, leftover: Leftover) -> None:
        """Remove that one location (a local copy and the stored prefix of one attempt are two)."""


def listed_entry(job: Job, name: str) -> Mapping[str, Any]:
    """The listing entry of artifact ``name`` of a succeeded job.

    Raises:
        ArtifactNotFound: the job has no artifact of that name (or has not succeeded).
    """
    entry = next((a for a in job.artifacts if a["name"] == name), None)
    if job.status is not JobStatus.SUCCEEDED or entry is None:
        raise ArtifactNotFound(f"job {job.id} has no artifact named {name!r}; GET its /artifacts to list them")
    return entry
