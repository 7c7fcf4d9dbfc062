"""Service-level domain errors: their codes (the one list of every error response's ``error.code``), classes and
the checks that tell a full disk or a busy store from a bug. No web framework here: the workers, the store and the
Slurm ranks raise these too; ``service.api.error_responses`` turns any error into the JSON error body.
"""

from __future__ import annotations

import enum
import errno

__all__ = [
    "ERROR_CODES",
    "ErrorCode",
    "ServiceError",
    "Unauthorized",
    "TooManyJobs",
    "TooManyStreams",
    "AnalyzeBusy",
    "AnalysisAborted",
    "JobNotFound",
    "ArtifactNotFound",
    "InvalidTransition",
    "IdempotencyConflict",
    "BodyTooLarge",
    "InvalidRequest",
    "RangeNotSatisfiable",
    "DiskFull",
    "disk_full",
    "StoreBusy",
    "store_busy",
]

#: Every ``error.code`` an error response can carry: code -> (HTTP status, when). The one list: the OpenAPI
#: schema's ErrorCode enum is built from it, and a test checks every error class's code is here.
ERROR_CODES: dict[str, tuple[str, str]] = {
    "invalid_json": ("400", "the body is not JSON (or not sent as Content-Type: application/json)"),
    "unauthorized": ("401", "no API key, or one this server does not know"),
    "not_found": ("404", "no such route"),
    "job_not_found": ("404", "no such job (or not yours)"),
    "artifact_not_found": ("404", "no such artifact of the job"),
    "method_not_allowed": ("405", "the route exists but not with this method; `Allow` lists those it has"),
    "invalid_transition": ("409", "the job's status does not allow this (e.g. cancelling a finished job)"),
    "idempotency_conflict": ("409", "the Idempotency-Key was used with another body"),
    "body_too_large": ("413", "the body exceeds FP8FORGE_MAX_BODY_BYTES"),
    "range_not_satisfiable": ("416", "a Range header that is malformed, lists several ranges or lies outside the file"),
    "invalid_request": ("422", "a field is missing, unknown, of the wrong type or out of its bounds; `field` names it"),
    "invalid_model_reference": ("422", "`model` is malformed or points outside the allowed roots"),
    "model_not_found": ("422", "`model` is well formed but names no model this server can read"),
    "invalid_model_config": ("422", "the model's config.json declares more than FP8FORGE_MAX_MODEL_* allow, or "
                                    "something no model can be built from; the message names the config field"),
    "invalid_artifact": ("422", "a directory is not a complete fp8forge artifact"),
    "invalid_recipe": ("422", "a recipe field is unknown or out of range; `field` is `recipe.<name>`"),
    "invalid_calibration": ("422", "calibration settings or texts are unusable; `field` is `calibration[.<name>]`"),
    "quality_unavailable": ("422", "the model cannot be scored on next-token prediction (no language-model head "
                                   "or tokenizer, or the texts give nothing to score): a plan needs that score"),
    "invalid_pattern": ("422", "an include/exclude pattern is malformed or matches no Linear layer"),
    "too_many_jobs": ("429", "the API key has as many queued jobs as it may; see Retry-After"),
    "too_many_streams": ("429", "the API key has as many open event streams as FP8FORGE_MAX_EVENT_STREAMS_PER_KEY "
                                "allows; close one, or see Retry-After"),
    "http_error": ("4xx", "another refusal of the HTTP layer; the status says which"),
    "internal_error": ("500", "a bug; the server log has the traceback"),
    "conversion_failed": ("500", "the conversion ran but its result was inconsistent"),
    "cancelled": ("500", "the run was cancelled"),
    "artifact_upload_failed": ("500", "a job's worker could not upload its artifacts to the object store (job error)"),
    "backend_unavailable": ("503", "the backend needs a library or device this server lacks"),
    "analyze_busy": ("503", "every analysis process is busy and FP8FORGE_ANALYZE_QUEUE_DEPTH requests wait; see "
                            "Retry-After"),
    "analysis_aborted": ("503", "the analysis process died (e.g. out of memory) or ran past "
                                "FP8FORGE_ANALYZE_TIMEOUT_S"),
    "artifact_store_unavailable": ("503", "the object store holding the artifacts did not answer; see Retry-After"),
    "store_busy": ("503", "the job store did not answer within FP8FORGE_STORE_LOCK_TIMEOUT_S / "
                          "FP8FORGE_STORE_STATEMENT_TIMEOUT_S (e.g. the job's row is held by a stalled worker); see "
                          "Retry-After"),
    "disk_full": ("503", "a disk of the server is full: the job store could not record the request (see Retry-After); "
                         "as a job's error, its worker ran out of disk space on the last attempt"),
}

ErrorCode = enum.Enum("ErrorCode", [(code.upper(), code) for code in ERROR_CODES], type=str)
ErrorCode.__doc__ = "What went wrong, stable for programs to test (the HTTP status says the family):\n\n" + "\n".join(
    f"- `{code}` ({status}): {meaning}" for code, (status, meaning) in ERROR_CODES.items()
)


class ServiceError(Exception):
    """An error of the service itself, with a stable ``code`` and its HTTP status."""

    code = "internal_error"
    status_code = 500

    def __init__(self, message: str, *, field: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.headers = headers or {}


class Unauthorized(ServiceError):
    """No API key, or one this server does not know (401 with ``WWW-Authenticate: Bearer``)."""

    code = "unauthorized"
    status_code = 401

    def __init__(self, message: str) -> None:
        super().__init__(message, headers={"WWW-Authenticate": "Bearer"})


class TooManyJobs(ServiceError):
    """The caller's key has as many queued jobs as it may (429 with ``Retry-After``)."""

    code = "too_many_jobs"
    status_code = 429


class TooManyStreams(ServiceError):
    """The caller's key has as many open event streams as it may (429 with ``Retry-After``)."""

    code = "too_many_streams"
    status_code = 429


class AnalyzeBusy(ServiceError):
    """Every analysis process is busy and the queue before them is full (503 with ``Retry-After``)."""

    code = "analyze_busy"
    status_code = 503
    #: a refusal under load, not a failure: a traceback logged for each would only add to the load
    logged = False


class AnalysisAborted(ServiceError):
    """The analysis process died or ran past its time bound; it was replaced (503)."""

    code = "analysis_aborted"
    status_code = 503


class JobNotFound(ServiceError):
    code = "job_not_found"
    status_code = 404


class ArtifactNotFound(ServiceError):
    code = "artifact_not_found"
    status_code = 404


class InvalidTransition(ServiceError):
    """The job's status does not allow the requested change (e.g. cancelling a finished job)."""

    code = "invalid_transition"
    status_code = 409


class IdempotencyConflict(ServiceError):
    code = "idempotency_conflict"
    status_code = 409


class BodyTooLarge(ServiceError):
    code = "body_too_large"
    status_code = 413


class InvalidRequest(ServiceError):
    code = "invalid_request"
    status_code = 422


class RangeNotSatisfiable(ServiceError):
    """A ``Range`` header this server cannot serve; ``headers`` carries ``Content-Range: bytes */<size>``."""

    code = "range_not_satisfiable"
    status_code = 416


class DiskFull(ServiceError):
    """A disk of the server is full, so the request could not be recorded (503 with ``Retry-After``)."""

    code = "disk_full"
    status_code = 503


class StoreBusy(ServiceError):
    """The job store gave up waiting for a lock or a statement (503 with ``Retry-After``)."""

    code = "store_busy"
    status_code = 503


_SQLITE_FULL = 13
_PG_DISK_FULL = "53100"
_SQLITE_BUSY, _SQLITE_LOCKED = 5, 6
#: lock_not_available (lock_timeout, NOWAIT) and query_canceled (statement_timeout)
_PG_GAVE_UP = {"55P03", "57014"}


def store_busy(exc: BaseException) -> bool:
    """True when ``exc``, or an exception that caused it, is the store giving up on a lock or a statement:
    SQLite's busy/locked, PostgreSQL's lock_not_available or query_canceled. Such a request may succeed later."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for candidate in (current, getattr(current, "orig", None)):
            code = getattr(candidate, "sqlite_errorcode", None)
            if code is not None and code & 0xFF in (_SQLITE_BUSY, _SQLITE_LOCKED):
                return True
            if getattr(candidate, "sqlstate", None) in _PG_GAVE_UP:
                return True
        current = current.__cause__ or current.__context__
    return False


def disk_full(exc: BaseException) -> bool:
    """True when ``exc``, or an exception that caused it, says a disk is full: an ``OSError`` with ``ENOSPC``,
    SQLite's "database or disk is full", PostgreSQL's ``disk_full``, or a Rust library's "(os error 28)"
    (safetensors writes through Rust, and raises its own error type)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        for candidate in (current, getattr(current, "orig", None)):  # a SQLAlchemy error wraps the driver's
            if isinstance(candidate, OSError) and candidate.errno == errno.ENOSPC:
                return True
            code = getattr(candidate, "sqlite_errorcode", None)  # extended: the primary code is the low byte
            if code is not None and code & 0xFF == _SQLITE_FULL:
                return True
            if getattr(candidate, "sqlstate", None) == _PG_DISK_FULL:
                return True
        if f"(os error {errno.ENOSPC})" in str(current):
            return True
        current = current.__cause__ or current.__context__
    return False
