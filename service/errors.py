"""Service-level domain errors and the one place that turns any error into the JSON error body.

Every error response has the shape ``{"error": {"code", "message", "field"?}}``.
"""

from __future__ import annotations

import copy
import enum
import errno
import logging
import re
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from converters.errors import BackendUnavailableError, Fp8ForgeError
from service.redaction import server_directories, without_server_paths

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
    "error_response",
    "install_error_handler",
]

logger = logging.getLogger(__name__)

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


_HTTP_CODES = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed", 413: "body_too_large",
               416: "range_not_satisfiable"}
# pydantic puts the tag of a discriminated union's variant into `loc` (the request schemas write tags as
# "[te delayed]"); the client never sent it, so the field path leaves it out
_UNION_TAG = re.compile(r"\[.*\]")


def _body(code: str, message: str, field: str | None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if field:
        error["field"] = field
    return {"error": error}


def client_path(loc: Sequence[Any]) -> str:
    """A validation error's location as the client wrote it: ``recipe.margin``, ``calibration.texts[2]``.

    The first item (``body``, ``query``, ``header``, ``path``) and union tags are left out; a header or query
    parameter is named as sent (``Last-Event-ID``, ``limit``).
    """
    items = list(loc[1:]) if loc and loc[0] in ("body", "query", "path", "header", "cookie") else list(loc)
    path = ""
    for index, item in enumerate(items):
        if isinstance(item, int):
            path += f"[{item}]"
        elif not (_UNION_TAG.fullmatch(str(item)) and index < len(items) - 1):
            path += f".{item}" if path else str(item)
    return path


def _error_path(error: dict[str, Any]) -> str:
    path = client_path(tuple(error.get("loc", ())))
    if error.get("type") in ("union_tag_invalid", "union_tag_not_found"):
        # the error sits on the union; the client's mistake is in the field that picks the variant
        name = str(error.get("ctx", {}).get("discriminator", "")).strip("'")
        path = f"{path}.{name}" if path and name.isidentifier() else path
    return path


def _validation(exc: RequestValidationError) -> tuple[int, str, str, str | None]:
    errors = list(exc.errors()) or [{"loc": ("body",), "msg": "invalid request"}]
    first = errors[0]
    if first.get("type") == "json_invalid":
        detail = first.get("ctx", {}).get("error", "decode error")
        return 400, "invalid_json", f"the body is not valid JSON ({detail})", None
    if tuple(first.get("loc", ())) == ("body",) and isinstance(first.get("input"), (bytes, bytearray)):
        return 400, "invalid_json", "the body must be JSON, sent with Content-Type: application/json", None
    message = "; ".join(f"{_error_path(e) or 'body'}: {e['msg']}" for e in errors)
    return 422, "invalid_request", message, _error_path(first) or "body"


def _describe(exc: Exception) -> tuple[int, str, str, str | None]:
    if isinstance(exc, ServiceError):
        return exc.status_code, exc.code, exc.message, exc.field
    if isinstance(exc, Fp8ForgeError):
        if exc.is_bad_input:
            status, generic = 422, "invalid_request"
        else:
            status, generic = (503 if isinstance(exc, BackendUnavailableError) else 500), "internal_error"
        # the library's base class carries no specific code; the API answers only codes from ERROR_CODES
        code = exc.code if exc.code in ERROR_CODES else generic
        return status, code, exc.message, exc.field
    if isinstance(exc, RequestValidationError):
        return _validation(exc)
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail), None
    return 500, "internal_error", "internal server error; see the server log", None


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def _allowed_methods(request: Request) -> str:
    """Every method some route serves at this path (Starlette's 405 names only the first route's methods)."""
    routes = request.app.router.routes
    return ", ".join(method for method in _METHODS if any(
        route.matches({**request.scope, "method": method})[0] is Match.FULL for route in routes))


def error_response(exc: Exception) -> JSONResponse:
    """Map any exception to the JSON error response (also used by middleware outside the router)."""
    if not isinstance(exc, ServiceError) and disk_full(exc):  # not a bug: the client may try again later
        full = DiskFull("a disk of the server is full, so the request could not be recorded; try again later",
                        headers={"Retry-After": "60"})
        full.__cause__, exc = exc, full
    elif not isinstance(exc, ServiceError) and store_busy(exc):  # a stalled holder of a row, not a bug of ours
        busy = StoreBusy("the job store is busy (a lock or statement timed out); try again shortly",
                         headers={"Retry-After": "5"})
        busy.__cause__, exc = exc, busy
        busy.logged = False  # one warning line below, not an error with a traceback
        logger.warning("request gave up on the store: %s", str(busy.__cause__).splitlines()[0][:300])
    status, code, message, field = _describe(exc)
    if status >= 500 and getattr(exc, "logged", True):
        logger.error("request failed: %s", message, exc_info=exc)
    headers = getattr(exc, "headers", None)  # e.g. Content-Range on a 416, Allow on a 405
    return JSONResponse(_body(code, message, field), status_code=status, headers=headers)


def _redacted(request: Request, exc: Exception) -> Exception:
    """A library error whose message names a server directory, with the directory replaced (see service.redaction);
    the log keeps the original."""
    settings = getattr(request.app.state, "settings", None)
    if not isinstance(exc, Fp8ForgeError) or settings is None:
        return exc
    directories = server_directories(data_dir=settings.data_dir, cache_dir=settings.hf_cache,
                                     key_file=settings.api_keys_file)
    message = without_server_paths(exc.message, directories)
    if message != exc.message:
        redacted = copy.copy(exc)
        redacted.message = message
        return redacted
    return exc


async def _handle(request: Request, exc: Exception) -> JSONResponse:
    if isinstance(exc, StarletteHTTPException) and exc.status_code == 405:
        allow = _allowed_methods(request)
        message = f"{request.method} is not served at {request.url.path}; it serves {allow}"
        return JSONResponse(_body("method_not_allowed", message, None), status_code=405, headers={"Allow": allow})
    return error_response(_redacted(request, exc))


def install_error_handler(app: FastAPI) -> None:
    """Register the one handler for every error family the app can raise.

    Database and OS errors get their own entries: Starlette hands a bare ``Exception`` handler to its outermost
    middleware, which answers and then re-raises, so the server drops the connection; a store that is busy or a
    disk that is full is an answer (503), not a crash.
    """
    from sqlalchemy.exc import DBAPIError

    families = (ServiceError, Fp8ForgeError, RequestValidationError, StarletteHTTPException, DBAPIError, OSError,
                Exception)
    for family in families:
        app.add_exception_handler(family, _handle)
