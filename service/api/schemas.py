"""Pydantic request and response bodies of the HTTP API (``XCreate`` in, ``XPublic`` out)."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic.json_schema import SkipJsonSchema
from pydantic_core import PydanticCustomError

from converters.analysis.patterns import MAX_PATTERN_CHARS, MAX_PATTERNS, PATTERN_REGEX
from converters.artifact.layout import REPORT_FILE
from converters.pipeline.request import (
    KV_CACHE_DTYPES,
    KV_CACHE_FORMAT_NAMES,
    LIMITS,
    MAX_CALIBRATION_TOKENS,
    MAX_TEXT_CHARS,
    MAX_TEXTS_CHARS,
    MAX_TOKENS_PER_STEP,
    MIN_SQNR_DB_RANGE,
    NOT_BLANK,
    REMOVED_FIELDS,
    REQUANTIZE_TARGETS,
    SERVING_FORMAT_NAMES,
    SYNC_DEFAULTS,
    SYNC_LIMITS,
    SYNC_MAX_PARAMETERS,
    SYNC_MAX_TEXTS_CHARS,
    CalibrationSettings,
)
from converters.plan.settings import GPUS, OBJECTIVES, TARGETS
from converters.recipes.presets import RECIPE_NAMES
from service.api.recipe_schemas import STRICT, RecipeCreate, json_int
from service.errors import ErrorCode
from service.executors.slurm_options import SlurmCreate
from service.jobs import Job, JobStatus, Stage, TaskStatus, public_worker_name
from service.store.host_faults import public_host_name
from service.workers.task_kinds import task_kinds_description

if TYPE_CHECKING:
    from service.api.auth import Caller

__all__ = [
    "CalibrationCreate",
    "RequantizeCreate",
    "JobCreate",
    "AnalyzeCreate",
    "AnalyzeCalibrationCreate",
    "ProgressPublic",
    "ErrorPublic",
    "JobKind",
    "JobLinks",
    "JobPublic",
    "JobsPublic",
    "TaskPublic",
    "TasksPublic",
    "REQUANTIZE_REPORT",
    "job_kind",
    "ArtifactPublic",
    "ArtifactsPublic",
    "ErrorDetail",
    "ErrorBody",
    "HealthPublic",
    "ReadyPublic",
]

_CAL = CalibrationSettings()
_STEPS, _BATCH, _SEQ, _TEXTS = (LIMITS[name] for name in ("steps", "batch_size", "seq_len", "texts"))

Pattern = Annotated[str, Field(max_length=MAX_PATTERN_CHARS, pattern=PATTERN_REGEX, description=(
    "A dotted module path glob matching whole segments: `layers.2`, `*.mlp.*`, `model.**.down_proj`."))]
Patterns = Annotated[list[Pattern], Field(max_length=MAX_PATTERNS)]
ServingFormats = Annotated[list[Literal[SERVING_FORMAT_NAMES]], Field(  # type: ignore[valid-type]
    max_length=len(SERVING_FORMAT_NAMES), json_schema_extra={"uniqueItems": True})]
CalibrationText = Annotated[str, Field(max_length=MAX_TEXT_CHARS, pattern=NOT_BLANK,
                                       description="One text; not empty or blank.")]
MinSqnrDb = Annotated[float, Field(ge=MIN_SQNR_DB_RANGE[0], le=MIN_SQNR_DB_RANGE[1], allow_inf_nan=False, description=(
    "Layers whose output SQNR (dB) under the recipe is below this stay in high precision: reason `low_sqnr` in "
    "the report (a job does not convert them, an analysis marks them). Output SQNR: the layer's output from "
    "FP8-cast input and weight against the high-precision output, over the calibration data (300: exact)."))]
CompareRecipes = Annotated[list[Literal[tuple(RECIPE_NAMES)]], Field(  # type: ignore[valid-type]
    max_length=len(RECIPE_NAMES), json_schema_extra={"uniqueItems": True}, description=(
        "Recipes (at their defaults) whose per-layer SQNR to measure side by side from the same calibration: "
        + ", ".join(f"`{name}`" for name in RECIPE_NAMES) + "."))]


class CalibrationCreate(BaseModel):
    """Calibration run settings; unset fields take the library's defaults.

    Besides each number's range, one step (batch_size x seq_len) may hold at most {tokens} tokens and the
    whole run (steps x batch_size x seq_len) at most {total}: more does not fit a worker (422 otherwise).
    """

    model_config = STRICT
    steps: json_int(*_STEPS) | None = Field(None, description=f"Calibration batches (default {_CAL.steps}).")
    batch_size: json_int(*_BATCH) | None = Field(None, description=f"Sequences per batch (default {_CAL.batch_size}).")
    seq_len: json_int(*_SEQ) | None = Field(None, description=(
        f"Tokens per sequence (default {_CAL.seq_len}); at most the model's max_position_embeddings."))
    texts: Annotated[list[CalibrationText], Field(min_length=_TEXTS[0], max_length=_TEXTS[1])] | None = Field(
        None, description=f"Your own calibration texts instead of the built-in corpus, {MAX_TEXTS_CHARS} characters "
                    "in all at most.")
    backward: bool | None = Field(None, description="Also run backward passes (gradient amax).")


CalibrationCreate.__doc__ = CalibrationCreate.__doc__.format(tokens=MAX_TOKENS_PER_STEP, total=MAX_CALIBRATION_TOKENS)


class RequantizeCreate(BaseModel):
    """A model-free conversion: the checkpoint converted shard by shard from its files and config.json alone, the
    shards spread over the workers. Takes only model, include, exclude and skip_first_last besides this."""

    model_config = STRICT
    to: Literal[REQUANTIZE_TARGETS] = Field(  # type: ignore[valid-type]
        ..., description="Target format (as `fp8forge requantize --to`): " + ", ".join(REQUANTIZE_TARGETS) + ".")
    measure: bool | None = Field(
        None, description="Measure each converted weight's SQNR under the format for the report (a pass over every "
                          "weight and its codes, about as costly as the cast; the default). `false`: the same bytes, "
                          "the report without the figures (as `fp8forge requantize --no-measure`).")


class PlanCreate(BaseModel):
    """A per-layer precision plan made beside the artifact (docs/plan.md): exactly one target; the plan, its
    measured end-to-end figures and the framework files land in the report's `plan` block and in plan/."""

    model_config = STRICT
    target_kl: float | None = Field(None, ge=TARGETS["target_kl"][0], le=TARGETS["target_kl"][1],
                                    allow_inf_nan=False, description="Mean next-token KL budget (nats per token).")
    max_ppl_increase: float | None = Field(
        None, ge=TARGETS["max_ppl_increase"][0], le=TARGETS["max_ppl_increase"][1], allow_inf_nan=False,
        description="Perplexity budget: points over the source's.")
    min_sqnr_db: float | None = Field(None, ge=TARGETS["min_sqnr_db"][0], le=TARGETS["min_sqnr_db"][1],
                                      allow_inf_nan=False, description="Every planned layer's output SQNR (dB).")
    objective: Literal[OBJECTIVES] | None = Field(  # type: ignore[valid-type]
        None, description="memory (default): least weight bytes; fp8-flops: most GEMM FLOPs in FP8/FP4.")
    gpu: Literal[tuple(GPUS)] | None = Field(  # type: ignore[valid-type]
        None, description="The GPU the plan is for (default h100): it decides which recipes are candidates.")


class JobCreate(BaseModel):
    """A conversion request. The conversion library checks it again, in depth, before it is queued."""

    model_config = STRICT
    model: str = Field(..., min_length=1, max_length=1024, examples=["demo/tiny-llama"],
                       description='"org/name[@rev]", a local path under an allowed root, or "demo/tiny-llama".')
    recipe: RecipeCreate | None = Field(
        None, description='How to convert, chosen by `backend` (and `scaling` for te); default {"backend": "te"}.')
    calibration: CalibrationCreate = Field(default_factory=CalibrationCreate)
    include: Patterns | None = Field(None, description="Module-name patterns to convert (default: all).")
    exclude: Patterns | None = Field(None, description="Module-name patterns never to convert.")
    skip_first_last: bool | None = Field(None, description="Keep the first and last Linear in high precision.")
    convert_router_gates: bool | None = Field(None, description="Also convert MoE router gates.")
    te_extra_state: bool | None = Field(None, description="Store TE's _extra_state (scaling state) too.")
    serving_formats: ServingFormats | None = Field(
        None, description="Serving checkpoints to write as well, each in serving/<name>/, each at most once: "
                    + ", ".join(SERVING_FORMAT_NAMES) + ".")
    kv_cache: Literal[KV_CACHE_DTYPES] | None = Field(  # type: ignore[valid-type]
        None, description="`fp8`: the serving checkpoints also carry FP8 KV-cache scales (k_scale/v_scale per "
                    "attention layer, from this job's calibration) and declare them, so vLLM and SGLang run "
                    "`--kv-cache-dtype fp8` with calibrated scales. Needs one of these in serving_formats: "
                    + ", ".join(KV_CACHE_FORMAT_NAMES) + ".")
    min_sqnr_db: MinSqnrDb | None = None
    measure: bool | None = Field(
        None, description="Measure each eligible layer's SQNR during calibration (default true); false makes the "
                    "job cost only the calibration forward, and the report says the measurement was off. "
                    "min_sqnr_db and compare_recipes need it.")
    plan: PlanCreate | None = Field(None, description="Also make a per-layer precision plan (docs/plan.md).")
    quality_texts: Annotated[list[CalibrationText], Field(min_length=_TEXTS[0], max_length=_TEXTS[1])] | None = Field(
        None, description="Held-out texts the end-to-end quality (perplexity, next-token KL, top-1 agreement against "
                    "the source; docs/quality.md) is measured on, instead of the built-in corpus' held-out part, "
                    f"{MAX_TEXTS_CHARS} characters in all. `measure: false` turns quality off too.")
    requantize: RequantizeCreate | None = Field(
        None, description="Convert from the files alone instead of calibrating (docs/requantize.md): no recipe, "
                    "calibration or serving_formats; each shard is a task any worker may run.")
    slurm: SlurmCreate | None = Field(
        None, description="This job's Slurm allocation over the server's FP8FORGE_SLURM_* settings (docs/deployment.md"
                    "); only on a server whose executor is slurm.")

    #: removed (converters.pipeline.request.REMOVED_FIELDS): kept out of the schema and refused by name, so that an
    #: old client that still sends it reads why and what to do instead of "extra inputs are not permitted"
    max_shard_bytes: SkipJsonSchema[Any] = Field(None, exclude=True)

    @field_validator("max_shard_bytes", mode="before")
    @classmethod
    def _refuse_removed(cls, value: Any, info: Any) -> Any:
        raise PydanticCustomError("removed_field", REMOVED_FIELDS[info.field_name])

    def to_request(self) -> dict[str, Any]:
        """The body as the conversion library reads it (unset optional fields left out; the recipe as sent)."""
        request = self.model_dump(mode="json", exclude_none=True, exclude={"recipe"})
        if self.recipe is not None:
            request["recipe"] = self.recipe.model_dump(mode="json", exclude_unset=True, exclude_none=True)
        return request


_SYNC_STEPS, _SYNC_BATCH, _SYNC_SEQ, _SYNC_TEXTS = (SYNC_LIMITS[name] for name in ("steps", "batch_size", "seq_len",
                                                                                   "texts"))


class AnalyzeCalibrationCreate(BaseModel):
    """A short calibration, run synchronously inside the request; unset fields take these defaults.

    Bounded so that the answer comes in seconds: at most {steps} steps of {batch} x {seq} tokens, {texts} texts
    of {chars} characters in all, a model of at most {params:,} parameters (422 otherwise). For more, run
    `fp8forge compare` or a conversion job (its report holds the SQNR under its recipe).
    """

    model_config = STRICT
    steps: json_int(*_SYNC_STEPS) | None = Field(None, description=f"Batches (default {SYNC_DEFAULTS['steps']}).")
    batch_size: json_int(*_SYNC_BATCH) | None = Field(
        None, description=f"Sequences per batch (default {SYNC_DEFAULTS['batch_size']}).")
    seq_len: json_int(*_SYNC_SEQ) | None = Field(
        None, description=f"Tokens per sequence (default {SYNC_DEFAULTS['seq_len']}).")
    texts: Annotated[list[Annotated[CalibrationText, Field(max_length=SYNC_MAX_TEXTS_CHARS)]],
                     Field(min_length=_SYNC_TEXTS[0], max_length=_SYNC_TEXTS[1])] | None = Field(
        None, description=f"Your own texts instead of the built-in corpus, {SYNC_MAX_TEXTS_CHARS} characters in all "
                          "at most.")


AnalyzeCalibrationCreate.__doc__ = AnalyzeCalibrationCreate.__doc__.format(
    steps=_SYNC_STEPS[1], batch=_SYNC_BATCH[1], seq=_SYNC_SEQ[1], texts=_SYNC_TEXTS[1], chars=SYNC_MAX_TEXTS_CHARS,
    params=SYNC_MAX_PARAMETERS)


class AnalyzeCreate(BaseModel):
    """Which Linear layers of a model a conversion would convert, and with a calibration, at what error.

    With `calibration`, `compare_recipes` or `min_sqnr_db` the weights are loaded and a short calibration runs
    in the request (see AnalyzeCalibrationCreate for its bounds): each eligible layer gets `sqnr_db`
    (weight, input, output) under the backend's default recipe, `sensitivity` says how it was measured, and
    `comparison` holds the table of `compare_recipes`.
    """

    model_config = STRICT
    model: str = Field(..., min_length=1, max_length=1024, examples=["demo/tiny-llama"],
                       description='"org/name[@rev]", a local path under an allowed root, or "demo/tiny-llama".')
    backend: Literal["te", "ao"] = Field("te", description='"te" (TransformerEngine) or "ao" (torchao).')
    include: Patterns = Field(default_factory=list)
    exclude: Patterns = Field(default_factory=list)
    skip_first_last: bool = True
    convert_router_gates: bool = Field(False, description="Also count MoE router gates as convertible.")
    calibration: AnalyzeCalibrationCreate | None = Field(
        None, description="Calibrate (synchronously) and report each layer's SQNR; implied by the two fields below.")
    compare_recipes: CompareRecipes | None = None
    min_sqnr_db: MinSqnrDb | None = None
    recipe: RecipeCreate | None = Field(
        None, description="The recipe whose shape rule the analysis applies (dimensions divisible by 16; by 32 for "
                    "MXFP8, by 128 for FP8 block scaling and NVFP4) and, with a calibration, whose SQNR is measured; "
                    "default: the backend's default recipe. Its `backend` is the analysis's (`backend`, if sent, "
                    "must be the same).")

    def recipe_json(self) -> dict[str, Any] | None:
        """``recipe`` as the conversion library reads it (as sent), or None."""
        if self.recipe is None:
            return None
        return self.recipe.model_dump(mode="json", exclude_unset=True, exclude_none=True)

    def calibrates(self) -> bool:
        return self.calibration is not None or bool(self.compare_recipes) or self.min_sqnr_db is not None


class ProgressPublic(BaseModel):
    fraction: float = Field(..., ge=0, le=1, description="Overall fraction done, 0..1.")
    stage_done: int = Field(..., description="Steps done in the current stage.")
    stage_total: int = Field(..., description="Steps in the current stage (0 when unknown).")


class ErrorPublic(BaseModel):
    code: str
    message: str


#: A requantize job's report (converters.modelfree.driver.REPORT_NAME: that module imports torch, this one may not).
REQUANTIZE_REPORT = "requantize_report.json"

JobKind = Literal["calibrated", "requantize", "plan"]


def job_kind(request: Mapping[str, Any]) -> JobKind:
    """What a job does, from its stored request: ``requantize`` (model-free, shard tasks over the workers),
    ``plan`` (calibrated, with a per-layer precision plan) or ``calibrated``."""
    if request.get("requantize"):
        return "requantize"
    return "plan" if request.get("plan") else "calibrated"


class JobLinks(BaseModel):
    self: str
    events: str
    artifacts: str
    report: str | None = Field(None, description=(
        "The job's report once it has succeeded: fp8_report.json, or requantize_report.json for a requantize job."))
    tasks: str | None = Field(None, description="Which worker ran each of the job's tasks (shards).")
    archive: str | None = Field(None, description="Every artifact in one tar, once the job has succeeded.")


class JobPublic(BaseModel):
    id: str
    kind: JobKind = Field(..., description=(
        "calibrated: a conversion with calibration; plan: the same with a per-layer precision plan (request "
        "field plan); requantize: converted from the files alone (request field requantize), shard by shard."))
    status: JobStatus
    stage: Stage | None
    progress: ProgressPublic
    attempt: int
    max_attempts: int
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    worker_id: str | None = Field(..., description="An opaque name of the worker that runs (or ran) the job.")
    error: ErrorPublic | None
    request: dict[str, Any] | None = Field(
        ..., description="The submitted request; only its owner sees it (null for anyone else, an admin too). "
                         "In GET /v1/jobs without calibration.texts: GET /v1/jobs/{id} has them.")
    links: JobLinks

    @classmethod
    def from_job(cls, job: Job, caller: Caller) -> JobPublic:
        base = f"/v1/jobs/{job.id}"
        reports = (REPORT_FILE, REQUANTIZE_REPORT)
        report = next((a["name"] for a in job.artifacts if a["name"] in reports), None)
        report = report or next((a["name"] for a in job.artifacts if a["name"].endswith(REPORT_FILE)), None)
        return cls(
            id=job.id, kind=job_kind(job.request), status=job.status, stage=job.stage,
            progress=ProgressPublic(fraction=job.progress, stage_done=job.stage_done, stage_total=job.stage_total),
            attempt=job.attempt, max_attempts=job.max_attempts, created_at=_ts(job.created_at),
            updated_at=_ts(job.updated_at), started_at=_ts(job.started_at), finished_at=_ts(job.finished_at),
            worker_id=public_worker_name(job.worker_id),
            error=ErrorPublic(code=job.error_code, message=job.error_message or "") if job.error_code else None,
            request=dict(job.request) if caller.may_read_request(job) else None,
            links=JobLinks(self=base, events=f"{base}/events", artifacts=f"{base}/artifacts",
                           report=f"{base}/artifacts/{report}" if report else None, tasks=f"{base}/tasks",
                           archive=f"{base}/archive" if job.status is JobStatus.SUCCEEDED else None),
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


class TaskPublic(BaseModel):
    """One task of a job: a requantize job's plan, amax, shard write and finish tasks, or a calibrated job's
    serving-export shard writes."""

    name: str = Field(..., description="The shard it writes, or its kind for a task of no shard.")
    kind: str = Field(..., description=task_kinds_description())
    shard: str | None
    status: TaskStatus
    attempt: int = Field(..., description="Claims so far (a task whose worker was lost runs again).")
    max_attempts: int
    worker: str | None = Field(..., description="The opaque name of the worker that ran it last (as worker_id "
                                                "in a job's body).")
    host: str | None = Field(..., description="The host that ran it last: its name for admins (and on a server "
                                              "without API keys), for everyone else a stable opaque name (as in "
                                              "the job's events) that tells hosts apart.")
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    seconds: float | None = Field(..., description="From its last start to its end (or to now while it runs).")
    error: ErrorPublic | None

    @classmethod
    def from_row(cls, row: Mapping[str, Any], caller: Caller, now: float) -> TaskPublic:
        started, finished = row["started_at"], row["finished_at"]
        end = finished if finished is not None else now if row["status"] == TaskStatus.RUNNING.value else None
        return cls(
            name=row["shard"] or row["kind"], kind=row["kind"], shard=row["shard"], status=row["status"],
            attempt=row["attempt"], max_attempts=row["max_attempts"], worker=public_worker_name(row["worker_id"]),
            host=row["host"] if caller.local or caller.admin else public_host_name(row["host"]),
            created_at=_ts(row["created_at"]),
            started_at=_ts(started), finished_at=_ts(finished),
            seconds=round(end - started, 3) if started is not None and end is not None else None,
            error=ErrorPublic(code=row["error_code"], message=row["error_message"] or "")
            if row["error_code"] else None,
        )


class TasksPublic(BaseModel):
    data: list[TaskPublic]
    count: int


class ErrorDetail(BaseModel):
    code: ErrorCode
    message: str = Field(..., description="What was wrong and how to fix it, for people.")
    field: str | None = Field(None, description=(
        "The input at fault as the client sent it: a dotted path into the body (`recipe.margin`, "
        "`calibration.texts[2]`), or a header or query parameter name (`Last-Event-ID`, `limit`)."))


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
