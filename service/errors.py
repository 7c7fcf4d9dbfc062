"""Service-level domain errors and the one place that turns any error into the JSON error body.

Every error response has the shape ``{"error": {"code", "message", "field"?}}``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from converters.errors import BackendUnavailableError, Fp8ForgeError

__all__ = [
    "ServiceError",
    "Unauthorized",
    "TooManyJobs",
    "JobNotFound",
    "ArtifactNotFound",
    "InvalidTransition",
    "IdempotencyConflict",
    "BodyTooLarge",
    "InvalidRequest",
    "RangeNotSatisfiable",
    "error_response",
    "install_error_handler",
]

logger = logging.getLogger(__name__)


class ServiceError(Exception):
    """An error of the service itself, with a stable ``code`` and its HTTP status."""

    code = "service_error"
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


_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 400: "bad_request", 413: "body_too_large",
               416: "range_not_satisfiable"}


def _body(code: str, message: str, field: str | None) -> dict[str, Any]:
    error: dict[str, Any] = {"code": code, "message": message}
    if field:
        error["field"] = field
    return {"error": error}


def _validation_field(loc: tuple[Any, ...]) -> str:
    parts = [str(p) for p in loc]
    if parts and parts[0] in ("body", "query", "path", "header"):
        parts = parts[1:]
    return ".".join(parts)


def _describe(exc: Exception) -> tuple[int, str, str, str | None]:
    if isinstance(exc, ServiceError):
        return exc.status_code, exc.code, exc.message, exc.field
    if isinstance(exc, Fp8ForgeError):
        if exc.is_bad_input:
            status = 422
        else:
            status = 503 if isinstance(exc, BackendUnavailableError) else 500
        return status, exc.code, exc.message, exc.field
    if isinstance(exc, RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        field = _validation_field(tuple(first.get("loc", ())))
        message = "; ".join(f"{_validation_field(tuple(e['loc'])) or 'body'}: {e['msg']}" for e in errors)
        return 422, "invalid_request", message or "invalid request", field or None
    if isinstance(exc, StarletteHTTPException):
        return exc.status_code, _HTTP_CODES.get(exc.status_code, "http_error"), str(exc.detail), None
    return 500, "internal_error", "internal server error; see the server log", None


def error_response(exc: Exception) -> JSONResponse:
    """Map any exception to the JSON error response (also used by middleware outside the router)."""
    status, code, message, field = _describe(exc)
    if status >= 500:
        logger.error("request failed: %s", message, exc_info=exc)
    headers = getattr(exc, "headers", None)  # e.g. Content-Range on a 416, Allow on a 405
    return JSONResponse(_body(code, message, field), status_code=status, headers=headers)


async def _handle(_: Request, exc: Exception) -> JSONResponse:
    return error_response(exc)


def install_error_handler(app: FastAPI) -> None:
    """Register the one handler for every error family the app can raise."""
    for family in (ServiceError, Fp8ForgeError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(family, _handle)
