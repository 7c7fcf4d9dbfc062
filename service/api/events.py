"""A job's event log as server-sent events; the stream ends once the job has finished."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import datetime, timezone

import anyio
from anyio import to_thread

from service.errors import JobNotFound
from service.jobs import JobEvent
from service.store import JobStore

__all__ = ["format_event", "job_event_stream"]

_BATCH = 500


def format_event(event: JobEvent) -> str:
    """One SSE frame: ``id`` is the event's sequence number (send it back as ``Last-Event-ID``)."""
    payload = {"at": datetime.fromtimestamp(event.at, tz=timezone.utc).isoformat(), **event.data}
    return f"id: {event.seq}\nevent: {event.kind}\ndata: {json.dumps(payload)}\n\n"


async def job_event_stream(
    store: JobStore, job_id: str, after_seq: int = 0, *, poll_s: float = 0.5, keepalive_s: float = 15.0
) -> AsyncIterator[str]:
    """Yield the job's events after ``after_seq``, following new ones until the job has finished."""
    last, quiet = after_seq, 0.0
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
