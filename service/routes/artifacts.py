"""/v1/jobs/{id}/artifacts: listing and resumable downloads (ETag, Content-Length, Range)."""

from __future__ import annotations

from urllib.parse import quote

from fastapi import APIRouter
from fastapi.responses import FileResponse

from service.deps import DirsDep, JobDep
from service.routes import error_responses
from service.schemas import ArtifactPublic, ArtifactsPublic

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])

_FILE = {200: {"content": {"application/octet-stream": {}}, "description": "The file (206 for a Range)."},
         206: {"description": "The requested byte range."}, 416: {"description": "Range not satisfiable."}}


@router.get("/{job_id}/artifacts", operation_id="listArtifacts", responses=error_responses(404))
def list_artifacts(job: JobDep) -> ArtifactsPublic:
    """Every file of a succeeded job (empty until it has succeeded)."""
    data = [ArtifactPublic(name=a["name"], bytes=a["bytes"], sha256=a["sha256"],
                           url=f"/v1/jobs/{job.id}/artifacts/{quote(a['name'])}") for a in job.artifacts]
    return ArtifactsPublic(data=data, count=len(data))


def _file(job: JobDep, name: str, dirs: DirsDep) -> FileResponse:
    path, entry = dirs.resolve(job, name)
    return FileResponse(path, media_type="application/octet-stream", filename=path.name,
                        headers={"ETag": f'"{entry["sha256"]}"'})


@router.get("/{job_id}/artifacts/{name:path}", operation_id="downloadArtifact", response_class=FileResponse,
            responses={**_FILE, **error_responses(404)})
def download_artifact(job: JobDep, name: str, dirs: DirsDep) -> FileResponse:
    """The file, streamed; send ``Range: bytes=N-`` (and ``If-Range: <ETag>``) to resume."""
    return _file(job, name, dirs)


@router.head("/{job_id}/artifacts/{name:path}", operation_id="headArtifact", response_class=FileResponse,
             responses={**_FILE, **error_responses(404)})
def head_artifact(job: JobDep, name: str, dirs: DirsDep) -> FileResponse:
    """The download's headers only (size, ETag), e.g. to check before resuming."""
    return _file(job, name, dirs)
