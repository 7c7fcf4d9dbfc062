"""/v1/jobs/{id}/artifacts: listing and resumable downloads (ETag, Content-Length, Range, If-Range); /archive: all
of a job's files in one tar.

Files come from the local disk or, with ``FP8FORGE_ARTIFACT_STORE=s3``, from the object store: streamed
through the API, or a 307 to a pre-signed URL with ``FP8FORGE_ARTIFACT_DOWNLOADS=redirect``.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import quote

from fastapi import APIRouter, Header
from fastapi.responses import FileResponse
from starlette.responses import Response

from service.api.deps import JobDep, SettingsDep, StorageDep
from service.api.downloads import archive_response, artifact_response
from service.api.routes import error_responses
from service.api.schemas import ArtifactPublic, ArtifactsPublic, ErrorBody
from service.artifacts import ArtifactStorage
from service.config import Settings
from service.jobs import Job

__all__ = ["router"]

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"])

_FILE = {200: {"content": {"application/octet-stream": {}}, "description": "The file (206 for a Range)."},
         206: {"description": "The requested byte range."},
         416: {"model": ErrorBody,
               "description": "Range not satisfiable (one range of the file only); Content-Range: bytes */size."},
         503: {"model": ErrorBody, "description": "The object store holding the artifacts did not answer."}}
_REDIRECT = {307: {"description": "With FP8FORGE_ARTIFACT_DOWNLOADS=redirect: Location is a pre-signed URL of the "
                                  "object store; send the Range there."}}

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
            responses={**_FILE, **_REDIRECT, **error_responses(404, 422)})
def download_artifact(
    job: JobDep, name: str, storage: StorageDep, settings: SettingsDep, range_: RangeHeader = None,
    if_range: IfRangeHeader = None,
) -> Response:
    """The file, streamed; send ``Range: bytes=N-`` (and ``If-Range: <ETag>``) to resume."""
    return _download(job, name, storage, settings, range_, if_range, head=False)


@router.head("/{job_id}/artifacts/{name:path}", operation_id="headArtifact", response_class=FileResponse,
             responses={**_FILE, **error_responses(404, 422)})
def head_artifact(
    job: JobDep, name: str, storage: StorageDep, settings: SettingsDep, range_: RangeHeader = None,
    if_range: IfRangeHeader = None,
) -> Response:
    """The download's headers only (size, ETag), e.g. to check before resuming."""
    return _download(job, name, storage, settings, range_, if_range, head=True)


@router.get("/{job_id}/archive", operation_id="downloadJobArchive", response_class=FileResponse,
            responses={200: {"content": {"application/x-tar": {}},
                             "description": "Every artifact of the job, as <job id>/<name>, in one tar (streamed)."},
                       503: _FILE[503], **error_responses(404, 409, 422)})
def download_archive(job: JobDep, storage: StorageDep) -> Response:
    """All of a succeeded job's files in one tar, streamed; 409 before the job has succeeded. Single files (and
    resuming with ``Range``) go through ``/artifacts/{name}``."""
    return archive_response(job, storage)


def _download(
    job: Job, name: str, storage: ArtifactStorage, settings: Settings, range_: str | None, if_range: str | None,
    *, head: bool,
) -> Response:
    if not storage.remote:
        return artifact_response(job, name, storage, range_header=range_, if_range=if_range)  # type: ignore[arg-type]
    from service.api.object_downloads import object_response  # imports boto3: only where the store is in use

    return object_response(job, name, storage, range_header=range_, if_range=if_range,  # type: ignore[arg-type]
                           head=head, redirect=settings.artifact_downloads == "redirect")
