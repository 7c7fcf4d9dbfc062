"""Where job artifacts live: one interface, two implementations.

``ArtifactDirs`` (``local``) keeps them under ``<data_dir>/jobs`` (one host, or hosts sharing that disk);
``ObjectArtifacts`` (``s3``) keeps them in an S3-compatible bucket, so worker hosts need no shared disk.
``FP8FORGE_ARTIFACT_STORE`` picks one; :func:`open_storage` builds it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.artifacts.base import ArtifactStorage, ArtifactStoreUnavailable, ArtifactUploadFailed, Leftover
from service.artifacts.local import ArtifactDirs

if TYPE_CHECKING:
    from service.config import Settings

__all__ = [
    "ArtifactDirs",
    "ArtifactStorage",
    "ArtifactStoreUnavailable",
    "ArtifactUploadFailed",
    "Leftover",
    "open_storage",
]


def open_storage(settings: Settings) -> ArtifactStorage:
    """The artifact storage the settings name (boto3 is imported only for ``s3``)."""
    if settings.artifact_store == "s3":
        from service.artifacts.s3 import ObjectArtifacts  # imports boto3: only where the S3 store is configured

        return ObjectArtifacts.from_settings(settings)
    return ArtifactDirs(settings.jobs_dir)
