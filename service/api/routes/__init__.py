"""HTTP routers, one per resource; each route parses, calls one function, and returns a schema."""

from __future__ import annotations

from typing import Any

from service.api.schemas import ErrorBody

__all__ = ["error_responses"]

# What each error status means on this API; ErrorDetail.code says exactly which error it is.
_MEANINGS = {
    400: "The body is not JSON, or not sent as application/json (invalid_json).",
    401: "No API key, or one this server does not accept (unauthorized).",
    404: "No such job or artifact, or not yours.",
    409: "The job's status does not allow this, or the Idempotency-Key was used with another body.",
    413: "The body exceeds FP8FORGE_MAX_BODY_BYTES (body_too_large).",
    416: "A Range header that is malformed, lists several ranges or lies outside the file.",
    422: "A field, header or parameter is missing, unknown, of the wrong type or out of bounds; error.field names it.",
    429: "The API key has as many queued jobs (too_many_jobs) or open event streams (too_many_streams) as it may; "
         "see Retry-After.",
    503: "The backend needs a library or device this server lacks (backend_unavailable), or (analyze) every "
         "analysis process is busy (analyze_busy, see Retry-After) or the analysis died or ran too long "
         "(analysis_aborted).",
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer, all with the one error body."""
    return {code: {"model": ErrorBody, "description": _MEANINGS.get(code, "Error.")} for code in codes}
