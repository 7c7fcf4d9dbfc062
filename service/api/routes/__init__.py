"""HTTP routers, one per resource; each route parses, calls one function, and returns a schema."""

from __future__ import annotations

from typing import Any

from service.api.schemas import ErrorBody

__all__ = ["error_responses"]


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer, all with the one error body."""
    return {code: {"model": ErrorBody} for code in codes}
