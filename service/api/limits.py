"""Request body size limit, enforced before any route reads the body (HTTP 413)."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.errors import BodyTooLarge, error_response

__all__ = ["BodyLimitMiddleware"]

# A client that sends a body only somewhat too large gets the 413 after we read (and drop) the rest, so it
# sees the answer instead of a reset connection; beyond this factor we answer and close at once.
_DRAIN_FACTOR = 8


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes * _DRAIN_FACTOR:
            await self._reject(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # client went away
            size += len(message.get("body", b""))
            if size <= self.max_bytes:
                chunks.append(message.get("body", b""))
            elif size > self.max_bytes * _DRAIN_FACTOR:
                break
            more = message.get("more_body", False)
        if size > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        body, replayed = b"".join(chunks), False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(BodyTooLarge(
            f"request body exceeds {self.max_bytes} bytes (FP8FORGE_MAX_BODY_BYTES)"))
        response.headers["connection"] = "close"
        await response(scope, receive, send)
