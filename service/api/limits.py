"""Limits on what one client may hold of the API: the request body size, enforced before any route reads the body
(HTTP 413), and the event streams one API key may keep open (HTTP 429)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.error_responses import error_response
from service.errors import BodyTooLarge, TooManyStreams

__all__ = ["BodyLimitMiddleware", "StreamSlots", "stream_slots"]

#: What a client refused another event stream is told to wait; its open streams end when their jobs do.
STREAM_RETRY_AFTER_S = 10

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


class StreamSlots:
    """The event streams each API key has open, at most ``limit`` each: a stream holds a connection and a poll of
    the store every half second for as long as its job runs, so a key opening thousands would hold the server."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def acquire(self, key: str) -> Callable[[], None]:
        """Count one more stream of ``key``; returns the function that releases it (calling it twice is harmless).

        Raises:
            TooManyStreams: ``key`` has ``limit`` streams open (429 with ``Retry-After``).
        """
        with self._lock:
            if self._open.get(key, 0) >= self.limit:
                raise TooManyStreams(
                    f"this API key has {self.limit} event streams open, as many as it may "
                    "(FP8FORGE_MAX_EVENT_STREAMS_PER_KEY); close one, or poll GET /v1/jobs/{id} instead",
                    headers={"Retry-After": str(STREAM_RETRY_AFTER_S)})
            self._open[key] = self._open.get(key, 0) + 1
        released = False

        def release() -> None:
            nonlocal released
            with self._lock:
                if not released:
                    released = True
                    self._open[key] -= 1
                    if not self._open[key]:
                        del self._open[key]

        return release

    def open_count(self, key: str) -> int:
        with self._lock:
            return self._open.get(key, 0)


_CREATING = threading.Lock()


def stream_slots(app: Any) -> StreamSlots:
    """The app's :class:`StreamSlots`, made on first use from ``settings.max_event_streams_per_key``."""
    with _CREATING:
        slots = getattr(app.state, "event_stream_slots", None)
        if slots is None:
            slots = app.state.event_stream_slots = StreamSlots(app.state.settings.max_event_streams_per_key)
        return slots
