"""A response that streams a body from a blocking source, reading the next piece while the last one goes out.

Uvicorn offers ASGI no zero-copy send, so every byte is read into this process and written to the socket. Read
and written in turn, a download waited for each 1 MiB read's trip through the threadpool and ran at 0.55-0.75 of
what TCP on loopback carries; with the next read already running while a piece is sent, at 0.8-1.0 of it
(benchmarks/bench_api.py --parts download). A reader task handing pieces over a memory stream, or anyio's
``to_thread`` instead of a plain executor, each gave back about a fifth of that. At most two pieces are held per
download: the one going out and the one being read.

A client that disconnects cancels the sending; the read then running is left to finish in its thread, and the
source is closed after it (never under it).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor

import anyio
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

__all__ = ["PIECE_BYTES", "ReadAheadResponse"]

PIECE_BYTES = 1 << 20  # larger pieces bought nothing on loopback and cost memory per download
# Reads of every download share these threads (not the API's threadpool, which serves its routes): a download
# has at most one read running, and more downloads than threads only queue their reads. As many as object-store
# reads, which wait on the network, may want at once; the pool starts threads only as reads need them.
_READERS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="fp8forge-read")


class ReadAheadResponse(Response):
    """Streams ``length`` bytes that :meth:`read` returns piece by piece (nothing for HEAD), then :meth:`close`."""

    media_type = "application/octet-stream"

    def __init__(self, length: int, *, status_code: int, headers: dict[str, str]) -> None:
        self.length = length
        self.status_code = status_code
        self.background = None
        self.init_headers({**headers, "content-length": str(length)})
        self._reading: Future[bytes] | None = None

    def read(self, size: int) -> bytes:
        """The next at most ``size`` bytes of the body (``b""``: the source ended early); runs in a thread."""
        raise NotImplementedError

    def close(self) -> None:
        """Release the source; called once, after every read has returned."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if scope.get("method") == "HEAD" or self.length == 0:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_cancel_on_disconnect, receive, tasks.cancel_scope)
                await self._send_body(send)
                tasks.cancel_scope.cancel()
        finally:
            if self._reading is None:
                self.close()
            else:  # at once if the last read is over, else by its thread as it returns
                self._reading.add_done_callback(lambda _: self.close())

    async def _send_body(self, send: Send) -> None:
        left = self.length
        self._reading = _READERS.submit(self.read, min(PIECE_BYTES, left))
        while left > 0:
            piece = await asyncio.wrap_future(self._reading)
            if not piece:
                break
            left -= len(piece)
            if left > 0:
                self._reading = _READERS.submit(self.read, min(PIECE_BYTES, left))
            await send({"type": "http.response.body", "body": piece, "more_body": left > 0})
        if left > 0:  # the source ended early: the client sees a short body (and may resume), never wrong bytes
            await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _cancel_on_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()
