"""Artifacts on the local disk (the default storage): where attempts stage and publish files, listing, and safe
name resolution.

Every attempt of a job writes into its own directory, ``<data_dir>/jobs/.<job_id>.a<attempt>`` (the pipeline
stages that into ``..<job_id>.a<attempt>.partial`` and renames it when every file is written). Only the worker
that still owns the attempt publishes it as ``<job_id>/``, in the same transaction that records the success,
so a job's files always come from one attempt. Readers resolve names against the stored listing, never
against user-supplied paths, so ``..`` and friends cannot escape the directory.

The object store (``service.artifacts.s3``) keeps one of these as the workers' scratch space.
"""

import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from converters.artifact.layout import sha256_file, staging_dir_for
from service.artifacts.base import Leftover, listed_entry
from service.config import make_private_dir
from service.errors import ArtifactNotFound
from service.jobs import Job

__all__ = ["ArtifactDirs"]


# attempt directories and their staging siblings: .<id>.a<n> and ..<id>.a<n>.partial
_ATTEMPT = re.compile(r"\.\.?([0-9a-f]{32})\.a([0-9]+)(?:\.partial)?")


class ArtifactDirs:
    """The layout of ``<data_dir>/jobs``: an ``ArtifactStorage`` whose published files are ``<id>/``."""

    remote = False

    def __init__(self, jobs_dir: Path) -> None:
        self.root = jobs_dir

    def ensure(self) -> None:
        """Create the jobs directory (and the data dir above it) private to this user: see make_private_dir."""
        make_private_dir(self.root)

    def check(self) -> None:
        """Nothing to reach: the directory is created by :meth:`ensure`."""

    def final_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def attempt_dir(self, job_id: str, attempt: int) -> Path:
        """Where one attempt's pipeline run puts its finished files (the out_dir it is given)."""
        return self.root / f".{job_id}.a{attempt}"

    def staging_dir(self, job_id: str, attempt: int) -> Path:
        """Where the pipeline stages an attempt (its convention: a hidden ``.partial`` sibling of the out_dir)."""
        return staging_dir_for(self.attempt_dir(job_id, attempt))

    def upload(self, job_id: str, attempt: int, artifacts: list[dict[str, Any]], *,
               should_stop: Callable[[], bool] = lambda: False) -> None:
        """Nothing to send: the files are already where readers get them once renamed."""

    def publish(self, job_id: str, attempt: int, artifacts: Iterable[Mapping[str, Any]] = ()) -> None:
        """Rename an attempt's directory to the job's final one (fails if that already exists).

        Raises:
            OSError: the attempt's directory is gone, or the final directory exists.
        """
        os.rename(self.attempt_dir(job_id, attempt), self.final_dir(job_id))

    def is_published(self, job_id: str, attempt: int) -> bool:
        return self.final_dir(job_id).exists()

    def settle(self, job_id: str, attempt: int) -> None:
        """Nothing is left to drop: publishing moved the attempt's directory."""

    def unpublish(self, job_id: str, attempt: int) -> None:
        """Undo :meth:`publish` after the success could not be recorded (the files go back to the attempt)."""
        try:
            os.rename(self.final_dir(job_id), self.attempt_dir(job_id, attempt))
        except FileNotFoundError:
            pass

    def remove_attempt(self, job_id: str, attempt: int) -> None:
        """Remove what one attempt left (its directory and its staging directory), never the published files."""
        for path in (self.attempt_dir(job_id, attempt), self.staging_dir(job_id, attempt)):
            self._discard(job_id, path)

    def remove(self, job_id: str, *, below_attempt: int | None = None) -> None:
        """Remove a job's files: the final dir (at once: renamed, then deleted) and attempts' leftovers.

        Args:
            below_attempt: when given (by the worker starting that attempt, which owns the job, so any final dir
                is a stale one), only older attempts lose their directories; a newer attempt's, perhaps of
                another worker still running it, are left alone. Without it, every attempt's go too.
        """
        self._discard(job_id, self.final_dir(job_id))
        pattern = re.compile(rf"\.\.?{re.escape(job_id)}\.(?:a(\d+)(?:\.partial)?|partial|[0-9a-f]{{8}}\.deleting)")
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        for name in names:
            match = pattern.fullmatch(name)
            if match is None:
                continue
            attempt = match.group(1)
            if below_attempt is None or attempt is None or int(attempt) < below_attempt:
                self._discard(job_id, self.root / name)

    def leftovers(self) -> Iterator[Leftover]:
        """Every attempt directory (and staging directory) under the root; a published job's ``<id>/`` is none."""
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return
        for name in sorted(names):
            if match := _ATTEMPT.fullmatch(name):
                yield Leftover(match.group(1), int(match.group(2)), publishable=False)

    def discard(self, leftover: Leftover) -> None:
        self.remove_attempt(leftover.job_id, leftover.attempt)

    def _discard(self, job_id: str, path: Path) -> None:
        # Another process (a reaper, a DELETE, a newer attempt) may remove the same path at the same moment.
        if path.name.endswith(".deleting"):
            shutil.rmtree(path, ignore_errors=True)
            return
        trash = self.root / f".{job_id}.{uuid.uuid4().hex[:8]}.deleting"
        try:
            os.replace(path, trash)
        except FileNotFoundError:
            return
        shutil.rmtree(trash, ignore_errors=True)

    def index(
        self, job_id: str, manifest: Iterable[Mapping[str, Any]] = (), *, attempt: int | None = None
    ) -> list[dict[str, Any]]:
        """List every file of a published job (or of one attempt's directory) with its size and sha256.

        Hashes come from the pipeline's manifest when it covers a file of the same size; other files
        (the manifest itself, the report) are hashed here.
        """
        known = {m["name"]: m for m in manifest if "name" in m}
        directory = self.final_dir(job_id) if attempt is None else self.attempt_dir(job_id, attempt)
        listing = []
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            name = path.relative_to(directory).as_posix()
            size = path.stat().st_size
            entry = known.get(name)
            digest = entry["sha256"] if entry and entry.get("bytes") == size and entry.get("sha256") else None
            listing.append({"name": name, "bytes": size, "sha256": digest or sha256_file(path)})
        return listing

    def read_manifest(self, job_id: str) -> list[dict[str, Any]]:
        path = self.final_dir(job_id) / "manifest.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return []
        entries = data.get("files", data) if isinstance(data, dict) else data
        return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []

    def resolve(self, job: Job, name: str) -> tuple[Path, Mapping[str, Any]]:
        """The file behind an artifact name and its listing entry.

        Raises:
            ArtifactNotFound: the job has no artifact of that name (or has not succeeded).
        """
        entry = listed_entry(job, name)
        path = self.final_dir(job.id) / entry["name"]
        if not path.is_file():
            raise ArtifactNotFound(f"artifact {name!r} of job {job.id} is missing on disk")
        return path, entry
