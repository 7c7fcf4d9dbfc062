"""Where older imports find the local artifact directories; the storage interface is ``service.storage``."""

from service.storage.local import ArtifactDirs, sha256_file

__all__ = ["ArtifactDirs", "sha256_file"]
