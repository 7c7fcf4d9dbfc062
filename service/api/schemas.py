"""Pydantic request and response bodies of the HTTP API (``XCreate`` in, ``XPublic`` out)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from service.jobs import Job, JobStatus, Stage

__all__ = [
    "CalibrationCreate",
    "JobCreate",
    "AnalyzeCreate",
    "ProgressPublic",
    "ErrorPublic",
    "JobLinks",
    "JobPublic",
    "JobsPublic",
    "ArtifactPublic",
    "ArtifactsPublic",
    "ErrorDetail",
    "ErrorBody",
    "HealthPublic",
    "ReadyPublic",
]

_STRICT = ConfigDict(extra="forbid")


class CalibrationCreate(BaseModel):
    """Calibration run settings; unset fields take the library's defaults (ranges are checked there)."""

    model_config = _STRICT
    steps: int | None = Field(None, description="Calibration batches (library default 16).")
    batch_size: int | None = Field(None, description="Sequences per batch (default 2).")
    seq_len: int | None = Field(None, description="Tokens per sequence (default 128).")
    texts: list[str] | None = Field(None, description="Your own calibration texts instead of the built-in corpus.")
    backward: bool | None = Field(None, description="Also run backward passes (gradient amax).")


class JobCreate(BaseModel):
    """A conversion request. ``recipe`` is checked in depth by the conversion library before queueing."""

    model_config = _STRICT
    model: str = Field(..., min_length=1, max_length=1024,
                       description='"org/name[@rev]", a local path under an allowed root, or "demo/tiny-llama".')
    recipe: dict[str, Any] | None = Field(
        None, description='e.g. {"backend": "ao", "recipe_name": "tensorwise"}; default {"backend": "te"}.')
    calibration: CalibrationCreate = Field(default_factory=CalibrationCreate)
    include: list[str] | None = Field(None, description="Module-name patterns to convert (default: all).")
    exclude: list[str] | None = Field(None, description="Module-name patterns never to convert.")
    skip_first_last: bool | None = Field(None, description="Keep the first and last Linear in high precision.")
    convert_router_gates: bool | None = Field(None, description="Also convert MoE router gates.")
    max_shard_bytes: int | None = Field(None, description="Largest safetensors shard (default 5 GiB).")
    te_extra_state: bool | None = Field(None, description="Store TE's _extra_state (scaling state) too.")
    serving_formats: list[str] | None = Field(
        None, description='Serving checkpoints to write as well, each in serving/<name>/: '
                          '"compressed-tensors-fp8" (static), "compressed-tensors-fp8-dynamic", "fp8-block".')

    def to_request(self) -> dict[str, Any]:
        """The body as the conversion library reads it (unset optional fields left out)."""
        return self.model_dump(mode="json", exclude_none=True)


class AnalyzeCreate(BaseModel):
    model_config = _STRICT
    model: str = Field(..., min_length=1, max_length=1024)
    backend: str = Field("te", description='"te" (TransformerEngine) or "ao" (torchao).')
    include: list[str] = Field(default_factory=list)
    exclude: list[str] = Field(default_factory=list)
    skip_first_last: bool = True
    convert_router_gates: bool = Field(False, description="Also count MoE router gates as convertible.")


class ProgressPublic(BaseModel):
    fraction: float = Field(..., ge=0, le=1, description="Overall fraction done, 0..1.")
    stage_done: int = Field(..., description="Steps done in the current stage.")
    stage_total: int = Field(..., description="Steps in the current stage (0 when unknown).")


class ErrorPublic(BaseModel):
    code: str
    message: str


class JobLinks(BaseModel):
    self: str
    events: str
    artifacts: str
    report: str | None = None


class JobPublic(BaseModel):
    id: str
    status: JobStatus
    stage: Stage | None
    progress: ProgressPublic
    attempt: int
    max_attempts: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    worker_id: str | None
    error: ErrorPublic | None
    request: dict[str, Any]
    links: JobLinks

    @classmethod
    def from_job(cls, job: Job) -> JobPublic:
        base = f"/v1/jobs/{job.id}"
        report = next((a["name"] for a in job.artifacts if a["name"].endswith("fp8_report.json")), None)
        return cls(
            id=job.id, status=job.status, stage=job.stage,
            progress=ProgressPublic(fraction=job.progress, stage_done=job.stage_done, stage_total=job.stage_total),
            attempt=job.attempt, max_attempts=job.max_attempts, created_at=_ts(job.created_at),
            updated_at=_ts(job.updated_at), started_at=_ts(job.started_at), finished_at=_ts(job.finished_at),
            worker_id=job.worker_id,
            error=ErrorPublic(code=job.error_code, message=job.error_message or "") if job.error_code else None,
            request=dict(job.request),
            links=JobLinks(self=base, events=f"{base}/events", artifacts=f"{base}/artifacts",
                           report=f"{base}/artifacts/{report}" if report else None),
        )


class JobsPublic(BaseModel):
    data: list[JobPublic]
    count: int
    next_cursor: str | None = Field(None, description="Pass as ?cursor= for the next (older) page.")


class ArtifactPublic(BaseModel):
    name: str
    bytes: int
    sha256: str
    url: str


class ArtifactsPublic(BaseModel):
    data: list[ArtifactPublic]
    count: int


class ErrorDetail(BaseModel):
    code: str
    message: str
    field: str | None = None


class ErrorBody(BaseModel):
    error: ErrorDetail


class HealthPublic(BaseModel):
    status: str


class ReadyPublic(BaseModel):
    ready: bool
    store: bool
    workers: int


def _ts(value: float | None) -> datetime | None:
    return datetime.fromtimestamp(value, tz=timezone.utc) if value is not None else None
