"""A job's event log as server-sent events; the stream ends once the job has finished (or its client goes)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from datetime import datetime, timezone
from typing import Annotated

import anyio
from anyio import to_thread
from fastapi import Header
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from service.errors import JobNotFound
from service.jobs import JobEvent
from service.store import JobStore

__all__ = ["MAX_EVENT_ID", "LastEventIdHeader", "format_event", "job_event_stream", "event_stream_response"]

_BATCH = 500
#: The largest event id a store can issue (SQLite's 64-bit rowid); a larger Last-Event-ID was never sent by us,
#: and the store's driver cannot even bind it (2**63 overflowed SQLite's INTEGER and aborted the stream).
MAX_EVENT_ID = 2**63 - 1

#: The header as a route parameter: ``last_event_id: LastEventIdHeader = None``. The type is ``int``, not
#: ``int | None``: an absent header is None by default, and the schema must not offer clients a null header.
LastEventIdHeader = Annotated[int, Header(
    alias="Last-Event-ID", ge=0, le=MAX_EVENT_ID,
    description="The id of the last event you received; the stream resumes after it.")]


def format_event(event: JobEvent) -> str:
    """One SSE frame: ``id`` is the event's sequence number (send it back as ``Last-Event-ID``)."""
    payload = {"at": datetime.fromtimestamp(event.at, tz=timezone.utc).isoformat(), **event.data}
    return f"id: {event.seq}\nevent: {event.kind}\ndata: {json.dumps(payload)}\n\n"


async def job_event_stream(
    store: JobStore, job_id: str, after_seq: int = 0, *, poll_s: float = 0.5, keepalive_s: float = 15.0
) -> AsyncIterator[str]:
    """Yield the job's events after ``after_seq``, following new ones until the job has finished."""
    last, quiet = min(max(after_seq, 0), MAX_EVENT_ID), 0.0
    while True:
        try:
            # Read the status before the events: the final status event is written with the status change,
            # so once we have seen a finished status the next read contains everything.
            finished = (await to_thread.run_sync(store.get_job, job_id)).status.is_finished
        except JobNotFound:
            return  # deleted while we followed it
        events = await to_thread.run_sync(store.events.after, job_id, last, _BATCH)
        for event in events:
            last = event.seq
            yield format_event(event)
        if len(events) == _BATCH:
            continue
        if finished:
            return
        if events:
            quiet = 0.0
        elif quiet >= keepalive_s:
            quiet = 0.0
            yield ": keep-alive\n\n"
        await anyio.sleep(poll_s)
        quiet += poll_s


class _ReleasingStream(StreamingResponse):
    """A stream that calls ``release`` once it is over, however it ends: the job finished, the client went away,
    or sending failed."""

    def __init__(self, *args: object, release: Callable[[], None], **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


def event_stream_response(store: JobStore, job_id: str, after_seq: int, release: Callable[[], None]
                          ) -> StreamingResponse:
    """The SSE response of :func:`job_event_stream`; ``release`` (the caller's stream slot) is called when it ends."""
    return _ReleasingStream(
        job_event_stream(store, job_id, after_seq), media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, release=release,
    )
