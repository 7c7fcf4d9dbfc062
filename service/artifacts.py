"""Per-job artifact directories: where runs stage and publish files, listing, and safe name resolution.

A job's files appear under ``<data_dir>/jobs/<job_id>/`` only once the whole run succeeded (the pipeline
stages into ``.<job_id>.partial`` and renames it). Readers resolve names against the stored listing, never
against user-supplied paths, so ``..`` and friends cannot escape the directory.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from service.errors import ArtifactNotFound
from service.jobs import Job, JobStatus

__all__ = ["ArtifactDirs", "sha256_file"]

logger = logging.getLogger(__name__)

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ArtifactDirs:
    """The layout of ``<data_dir>/jobs``."""

    def __init__(self, jobs_dir: Path) -> None:
        self.root = jobs_dir

    def ensure(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def final_dir(self, job_id: str) -> Path:
        return self.root / job_id

    def staging_dir(self, job_id: str) -> Path:
        """Where the pipeline stages a run (its convention: a hidden ``.partial`` sibling)."""
        return self.root / f".{job_id}.partial"

    def remove(self, job_id: str) -> None:
        """Remove everything a job has on disk; the final dir disappears at once (renamed, then deleted)."""
        for path in (self.final_dir(job_id), self.staging_dir(job_id)):
            if not path.exists():
                continue
            trash = self.root / f".{job_id}.{uuid.uuid4().hex[:8]}.deleting"
            os.replace(path, trash)
            shutil.rmtree(trash, ignore_errors=True)

    def index(self, job_id: str, manifest: Iterable[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
        """List every file of a published job with its size and sha256.

        Hashes come from the pipeline's manifest when it covers a file of the same size; other files
        (the manifest itself, the report) are hashed here.
        """
        known = {m["name"]: m for m in manifest if "name" in m}
        directory = self.final_dir(job_id)
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
        entry = next((a for a in job.artifacts if a["name"] == name), None)
        if job.status is not JobStatus.SUCCEEDED or entry is None:
            raise ArtifactNotFound(f"job {job.id} has no artifact named {name!r}; GET its /artifacts to list them")
        path = self.final_dir(job.id) / entry["name"]
        if not path.is_file():
            raise ArtifactNotFound(f"artifact {name!r} of job {job.id} is missing on disk")
        return path, entry
