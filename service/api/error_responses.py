"""The one place that turns any error into the API's JSON error body ``{"error": {"code", "message", "field"?}}``:
the domain errors of ``service.errors``, the library's ``Fp8ForgeError``, request validation, Starlette's HTTP
errors, and a full disk or a busy store (503, not a crash).
"""

from __future__ import annotations

import copy
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
from service.errors import ERROR_CODES, DiskFull, ServiceError, StoreBusy, disk_full, store_busy
from service.redaction import server_directories, without_server_paths

__all__ = ["client_path", "error_response", "install_error_handler"]

logger = logging.getLogger(__name__)

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
