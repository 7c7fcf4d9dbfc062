"""``/readyz`` answers 503 within FP8FORGE_READY_TIMEOUT_S when the job store does not answer.

Two real ways a store stops answering: a PostgreSQL server that stops responding (a TCP relay on loopback that stops
relaying, as a hung server or a cut network looks to its clients), and a SQLite file whose write lock another
process holds (a real second connection inside ``BEGIN IMMEDIATE``, as a process stopped inside its write).
"""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest

from service.config import Settings
from service.store import JobStore
from tests.service.workers.test_multi_host import fresh_database
from tests.service_helpers import live_app, wait_for

READY_TIMEOUT_S = 1.0


class FreezableRelay:
    """Relays loopback TCP connections to ``port``; while frozen it holds every byte, in both directions."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.flowing = threading.Event()
        self.flowing.set()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self._sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                self.flowing.wait()
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self.flowing.set()
        self.listener.close()
        for sock in self._sockets:
            sock.close()


def _ready(client: httpx.Client) -> tuple[int, dict, float]:
    started = time.monotonic()
    response = client.get("/readyz")
    return response.status_code, response.json(), time.monotonic() - started


def _settings(tmp_path: Path, **values) -> Settings:
    return Settings(data_dir=tmp_path / "data", auth_disabled=True, workers=0, ready_timeout_s=READY_TIMEOUT_S,
                    **values)


@pytest.mark.postgres
def test_readyz_says_503_in_time_when_the_database_server_stops_answering(tmp_path: Path) -> None:
    with fresh_database() as db_url:
        relay = FreezableRelay(5432)
        relayed = db_url.replace("@127.0.0.1:5432/", f"@127.0.0.1:{relay.port}/")
        assert relayed != db_url
        store = JobStore(db_url)
        try:
            with live_app(_settings(tmp_path, database_url=relayed)) as client:
                store.workers.heartbeat("a-worker")
                assert _ready(client)[:2] == (200, {"ready": True, "store": True, "workers": 1})
                relay.flowing.clear()
                for _ in range(3):  # a hung check is not started again: each answer still comes in time
                    status, body, took = _ready(client)
                    assert (status, body) == (503, {"ready": False, "store": False, "workers": 0})
                    assert took < READY_TIMEOUT_S + 1.5, took
                relay.flowing.set()
                wait_for(lambda: _ready(client)[0] == 200, timeout=15, what="ready again once the server answers")
        finally:
            relay.close()
            store.close()


def test_readyz_says_503_in_time_when_a_stopped_process_holds_the_sqlite_write_lock(tmp_path: Path) -> None:
    settings = _settings(tmp_path)
    with live_app(settings) as client:
        store = JobStore(settings.store_url)
        store.workers.heartbeat("a-worker")
        store.close()
        assert _ready(client)[0] == 200
        holder = sqlite3.connect(settings.data_dir / "fp8forge.db", isolation_level=None)
        try:
            holder.execute("BEGIN IMMEDIATE")  # the write lock, held as by a process stopped inside its write
            status, body, took = _ready(client)
            assert (status, body["store"]) == (503, False)
            assert took < READY_TIMEOUT_S + 1.5, took
        finally:
            holder.rollback()
            holder.close()
        wait_for(lambda: _ready(client)[0] == 200, timeout=15, what="ready again once the lock is gone")
