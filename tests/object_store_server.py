"""A real S3-compatible HTTP server for the tests: moto's standalone server as a subprocess on a free loopback
port (not an in-process mock of boto3), a proxy in front of it that can cut an upload half-way, and settings
that point the service at a fresh bucket of it."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from service.config import Settings
from tests.service_helpers import free_port, wait_for

__all__ = ["AWS_ENV", "MotoServer", "CuttingProxy", "moto_server", "s3_settings", "new_bucket", "bucket_keys",
           "unfinished_uploads"]

# boto3 reads these; moto accepts any credentials. Two tries, so a store that is away fails an upload quickly.
AWS_ENV = {"AWS_ACCESS_KEY_ID": "fp8forge-test", "AWS_SECRET_ACCESS_KEY": "fp8forge-test",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": "2"}


class MotoServer:
    """``moto_server`` on 127.0.0.1, as its own process; ``client()`` talks to it directly."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._client: Any = None
        script = Path(sys.executable).with_name("moto_server")
        command = [str(script)] if script.exists() else [sys.executable, "-m", "moto.server"]
        with log.open("ab") as out:
            self.proc = subprocess.Popen([*command, "-H", "127.0.0.1", "-p", str(self.port)], stdout=out,
                                         stderr=subprocess.STDOUT, env={**os.environ, **AWS_ENV})
        wait_for(self._answers, timeout=30, what=f"moto_server on port {self.port}")

    def _answers(self) -> bool:
        assert self.proc.poll() is None, "moto_server exited at start"
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
            return True
        except OSError:
            return False

    def client(self) -> Any:
        """A boto3 S3 client of this server, made once: each new one loads boto3's service model (0.1 s of CPU)."""
        if self._client is None:
            import boto3

            self._client = boto3.session.Session(aws_access_key_id=AWS_ENV["AWS_ACCESS_KEY_ID"],
                                                 aws_secret_access_key=AWS_ENV["AWS_SECRET_ACCESS_KEY"]).client(
                "s3", endpoint_url=self.endpoint, region_name="us-east-1")
        return self._client

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@contextlib.contextmanager
def moto_server(log: Path) -> Iterator[MotoServer]:
    server = MotoServer(log)
    try:
        yield server
    finally:
        server.stop()


def new_bucket(server: MotoServer) -> str:
    name = f"fp8forge-{uuid.uuid4().hex[:12]}"
    server.client().create_bucket(Bucket=name)
    return name


def s3_settings(data_dir: Path, endpoint: str, bucket: str, **overrides: Any) -> Settings:
    """Settings of a service whose artifacts live in ``bucket`` under the prefix ``fp8forge/``."""
    values: dict[str, Any] = dict(
        data_dir=data_dir, artifact_store="s3", s3_bucket=bucket, s3_prefix="fp8forge", s3_endpoint_url=endpoint,
        s3_region="us-east-1", s3_part_size_bytes=5 << 20, hf_offline=True, auth_disabled=True,
        heartbeat_interval_s=0.2, poll_interval_s=0.1)
    return Settings(**{**values, **overrides})


def bucket_keys(server: MotoServer, bucket: str) -> list[str]:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", ()))


def unfinished_uploads(server: MotoServer, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", ()))


class CuttingProxy:
    """A loopback TCP proxy to ``upstream_port``: after :meth:`cut_after` it forwards that many more request
    bytes, then drops every connection and refuses new ones (the store is gone) until :meth:`heal`."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.forwarded = 0
        self.is_cut = threading.Event()
        self._limit: int | None = None
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self.heal()

    def cut_after(self, n_bytes: int) -> None:
        with self._lock:
            self.forwarded, self._limit = 0, n_bytes

    def heal(self) -> None:
        """Listen again (on the same port) and forward without a limit."""
        self._limit = None
        self.is_cut.clear()
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.1)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def cut(self) -> None:
        self.is_cut.set()
        with self._lock:
            doomed, self._sockets = self._sockets, []
        if self._listener is not None:
            self._listener.close()
        for sock in doomed:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    close = cut

    def _accept(self, listener: socket.socket) -> None:
        while not self.is_cut.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket, counted: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                if counted:
                    with self._lock:
                        self.forwarded += len(data)
                        over = self._limit is not None and self.forwarded >= self._limit
                    if over:
                        self.cut()
                        return
                target.sendall(data)
            target.shutdown(socket.SHUT_WR)
        except OSError:
            pass
