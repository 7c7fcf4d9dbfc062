"""/v1/jobs/{id}/artifacts: listing and resumable downloads (ETag, Content-Length, Range, If-Range)."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Header
from fastapi.responses import FileResponse

from service.api.deps import DirsDep, JobDep
from service.api.downloads import ArtifactResponse, artifact_response
from service.api.routes import error_responses
from service.api.schemas import ArtifactPublic, ArtifactsPublic, ErrorBody

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])

_FILE = {200: {"content": {"application/octet-stream": {}}, "description": "The file (206 for a Range)."},
         206: {"description": "The requested byte range."},
         416: {"model": ErrorBody,
               "description": "Range not satisfiable (one range of the file only); Content-Range: bytes */size."}}

# No max_length on Range: every Range this server cannot serve, a long one too, is 416 (parse_range).
RangeHeader = Annotated[str, Header(alias="Range",
                                    description="One byte range: bytes=a-b, bytes=a- or bytes=-n; 416 otherwise.")]
IfRangeHeader = Annotated[str, Header(alias="If-Range", max_length=200,
                                      description="The ETag the partial download started with.")]


@router.get("/{job_id}/artifacts", operation_id="listArtifacts", responses=error_responses(404, 422))
def list_artifacts(job: JobDep) -> ArtifactsPublic:
    """Every file of a succeeded job (empty until it has succeeded)."""
    data = [ArtifactPublic(name=a["name"], bytes=a["bytes"], sha256=a["sha256"],
                           url=f"/v1/jobs/{job.id}/artifacts/{quote(a['name'])}") for a in job.artifacts]
    return ArtifactsPublic(data=data, count=len(data))


@router.get("/{job_id}/artifacts/{name:path}", operation_id="downloadArtifact", response_class=FileResponse,
            responses={**_FILE, **error_responses(404, 422)})
def download_artifact(
    job: JobDep, name: str, dirs: DirsDep, range_: RangeHeader = None, if_range: IfRangeHeader = None,
) -> ArtifactResponse:
    """The file, streamed; send ``Range: bytes=N-`` (and ``If-Range: <ETag>``) to resume."""
    return artifact_response(job, name, dirs, range_header=range_, if_range=if_range)


@router.head("/{job_id}/artifacts/{name:path}", operation_id="headArtifact", response_class=FileResponse,
             responses={**_FILE, **error_responses(404, 422)})
def head_artifact(
    job: JobDep, name: str, dirs: DirsDep, range_: RangeHeader = None, if_range: IfRangeHeader = None,
) -> ArtifactResponse:
    """The download's headers only (size, ETag), e.g. to check before resuming."""
    return artifact_response(job, name, dirs, range_header=range_, if_range=if_range)
