"""Helpers for the service tests: stores on SQLite and PostgreSQL, a live uvicorn, `fp8forge serve`."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.config import Settings
from service.store import JobStore

__all__ = [
    "PG_URLS",
    "postgres_url",
    "make_store",
    "live_app",
    "api_client",
    "ServeProcess",
    "build_tiny_llama",
    "wait_for",
    "sse_events",
    "publish_job",
    "free_port",
    "fp8forge_command",
    "children_of",
    "is_fork_server",
    "is_fork_server_child",
    "parent_of",
    "work_children",
    "pid_alive",
    "leftovers",
]

PG_URLS = (
    "postgresql+psycopg://postgres@127.0.0.1:5432/test",
    "postgresql+psycopg://root@127.0.0.1:5432/test",
)
_pg_url: list[str | None] = []


def postgres_url() -> str | None:
    """The first PostgreSQL URL that answers (cached); None when the server is unreachable."""
    if not _pg_url:
        import sqlalchemy as sa

        found = None
        for url in PG_URLS:
            engine = sa.create_engine(url, connect_args={"connect_timeout": 3})
            try:
                with engine.connect() as conn:
                    conn.execute(sa.text("SELECT 1"))
                found = url
                break
            except Exception:  # noqa: BLE001 - try the next user
                continue
            finally:
                engine.dispose()
        _pg_url.append(found)
    return _pg_url[0]


@contextlib.contextmanager
def make_store(kind: str, tmp_path: Path) -> Iterator[tuple[JobStore, str, str]]:
    """A fresh store of ``kind`` ("sqlite" or "postgresql"); yields (store, url, table_prefix).

    PostgreSQL stores get their own table prefix, dropped afterwards, so parallel runs never collide.
    """
    if kind == "sqlite":
        url, prefix = f"sqlite:///{tmp_path / 'jobs.db'}", ""
    else:
        url = postgres_url()
        if url is None:
            pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432 (users postgres/root, database test)")
        prefix = f"t{uuid.uuid4().hex[:12]}_"
    store = JobStore(url, table_prefix=prefix)
    try:
        yield store, url, prefix
    finally:
        if kind == "sqlite":
            store.close()
        else:
            store.drop_all()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def queue_only_settings(root: Path) -> Settings:
    """A server whose jobs stay queued (no workers), without API keys, with an empty model root under ``root``."""
    (root / "models").mkdir(exist_ok=True)
    return Settings(data_dir=root / "data", allowed_model_roots=(root / "models",), workers=0,
                    auth_disabled=True, hf_offline=True)


def api_client(base_url: str, **options: Any) -> httpx.Client:
    """A client of a test server that never sends on a connection the server is closing: uvicorn closes a
    connection idle for 5 s (``timeout_keep_alive``) and httpx keeps one for 5 s by default, so a request sent
    after a 5-second pause could meet the server's close ("Connection reset by peer")."""
    return httpx.Client(base_url=base_url, timeout=30, limits=httpx.Limits(keepalive_expiry=2), **options)


@contextlib.contextmanager
def live_app(settings: Settings) -> Iterator[httpx.Client]:
    """Run ``create_app(settings)`` on a real uvicorn server on loopback; yields a client bound to it."""
    import uvicorn

    from service.main import create_app

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(create_app(settings), log_level="warning", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=15, what="uvicorn start")
        with api_client(f"http://127.0.0.1:{port}") as client:
            yield client
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def wait_for(predicate: Any, *, timeout: float, what: str, interval: float = 0.1) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def fp8forge_command() -> list[str]:
    """How to run the ``fp8forge`` CLI: the installed console script, else the module it runs."""
    script = Path(sys.executable).with_name("fp8forge")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "service.cli.main"]


def stop_process(proc: subprocess.Popen | None, *, grace_s: float = 30) -> None:
    """SIGTERM (a graceful stop: running jobs are requeued), then SIGKILL after ``grace_s``."""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServeProcess:
    """``fp8forge serve`` as a real subprocess on a free loopback port."""

    def __init__(self, data_dir: Path, *, workers: int = 1, env: dict[str, str] | None = None) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir.parent / f"serve-{self.port}.log"
        self.env = {**os.environ, "FP8FORGE_DATA_DIR": str(data_dir), "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1",
                    "HF_HUB_OFFLINE": "1", "FP8FORGE_HF_OFFLINE": "1", "FP8FORGE_AUTH_DISABLED": "1",
                    **(env or {})}
        self.workers = workers
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> ServeProcess:
        cmd = [*fp8forge_command(), "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", str(self.workers)]
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=Path(__file__).parents[1])
        self.wait_healthy()
        return self

    def wait_healthy(self) -> None:
        """Poll /healthz until it answers 200 (the process must stay alive meanwhile)."""
        # one client for every poll: httpx.get builds a client (and its SSL context) per call, about 25 ms of CPU
        # each, where a kept client's refused connection costs well under 1 ms
        with httpx.Client(timeout=2) as probe:
            wait_for(lambda: self._healthy(probe), timeout=60,
                     what=f"fp8forge serve on port {self.port}\n{self.tail()}")

    def _healthy(self, probe: httpx.Client) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"serve exited early:\n{self.tail()}"
        try:
            return probe.get(f"{self.base_url}/healthz").status_code == 200
        except httpx.TransportError:
            return False

    def stop(self) -> None:
        stop_process(self.proc)

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def client(self) -> httpx.Client:
        return api_client(self.base_url)

    def __enter__(self) -> ServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def build_tiny_llama(directory: Path) -> Path:
    """A two-layer Llama saved with ``save_pretrained`` (random weights, no tokenizer)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    return directory


def sse_events(client: httpx.Client, path: str, *, timeout: float = 120) -> list[tuple[str, dict[str, Any]]]:
    """Follow an SSE stream to its end; returns (event kind, data) pairs."""
    events: list[tuple[str, dict[str, Any]]] = []
    kind = "message"
    with client.stream("GET", path, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                kind = line[len("event: "):]
            elif line.startswith("data: "):
                events.append((kind, json.loads(line[len("data: "):])))
    return events


def publish_job(store: JobStore, jobs_dir: Path, files: dict[str, bytes]) -> Any:
    """A job driven to ``succeeded`` through the real store, with ``files`` as its published artifacts."""
    from service.artifacts import ArtifactDirs
    from service.jobs import JobStatus

    job, _ = store.create_job({"model": "demo/tiny-llama"}, request_hash=uuid.uuid4().hex)
    store.claim_next("test-worker")
    dirs = ArtifactDirs(jobs_dir)
    final = dirs.final_dir(job.id)
    final.mkdir(parents=True)
    for name, data in files.items():
        (final / name).write_bytes(data)
    return store.set_status(job.id, JobStatus.SUCCEEDED, owner="test-worker", artifacts=dirs.index(job.id))


def children_since(pid: int, before: set[int]) -> list[int]:
    """Live working children of ``pid`` (:func:`work_children`) not in ``before`` (taken at a test's start)."""
    return [child for child in work_children(pid) if child not in before]


def work_children(pid: int) -> list[int]:
    """The processes that work for ``pid``: its children, with its fork server (conversion and task children's, one
    per process for its life: ``service.workers.task_server``) replaced by the server's children."""
    found = []
    for child in children_of(pid):
        found += children_of(child) if is_fork_server(child) else [child]
    return found


def freeze_worker(pid: int) -> list[int]:
    """SIGSTOP worker ``pid`` and its working children (:func:`work_children`); returns the children. A frozen worker
    records nothing, so a kill -9 that follows lands while it holds what it held, however fast the machine."""
    os.kill(pid, signal.SIGSTOP)
    children = work_children(pid)
    for child in children:
        os.kill(child, signal.SIGSTOP)
    return children


def kill_9_frozen_worker(pid: int, children: list[int]) -> None:
    """kill -9 a worker frozen by :func:`freeze_worker`, then resume its children and wait for them to die with it.

    A child frozen before it tied itself to the worker (``service.workers.procs.die_with_worker``: a task is recorded
    running while its child starts) holds no kernel link to it and its fork server's "alive" pipe open, so it, the
    server and the tracker it holds stay stopped for good; resumed, each child finds its worker gone and ends."""
    os.kill(pid, signal.SIGKILL)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGCONT)
    wait_for(lambda: not any(pid_alive(child) for child in children), timeout=30,
             what="the frozen worker's children to die with it")


def is_fork_server(pid: int) -> bool:
    """Whether ``pid`` is a multiprocessing fork server (its forks run the same command line: its parent tells)."""
    return _runs_fork_server(pid) and not is_fork_server_child(pid)


def is_fork_server_child(pid: int) -> bool:
    """Whether ``pid`` is a fork of a multiprocessing fork server."""
    parent = parent_of(pid)
    return parent is not None and _runs_fork_server(parent) and _runs_fork_server(pid)


def parent_of(pid: int) -> int | None:
    """The parent process id of ``pid``; None once it has ended."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):  # it ended while we looked
        return None


def _runs_fork_server(pid: int) -> bool:
    try:
        return b"multiprocessing.forkserver" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # it ended while we looked
        return False


def children_of(pid: int) -> list[int]:
    """Live child process ids of ``pid`` (Linux /proc), leaving out multiprocessing's resource tracker."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != pid or fields[0] == "Z":
                continue
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:  # it ended while we looked
            continue
        if b"resource_tracker" not in cmdline:
            found.append(int(stat.parent.name))
    return found


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def leftovers(jobs_dir: Path) -> list[str]:
    """Staging or half-deleted directories under the jobs dir (there must be none once jobs settle)."""
    return sorted(p.name for p in jobs_dir.iterdir() if p.name.startswith(".")) if jobs_dir.exists() else []


def keepalive_requests(port: int, requests: list[tuple[str, str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """Send ``(method, path, JSON body or None)`` requests over ONE connection to 127.0.0.1:``port`` and return
    ``(status, body)`` pairs; fails if the server closed the connection in between."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    answers = []
    try:
        for method, path, body in requests:
            connection.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                               headers={"Content-Type": "application/json"})
            socket_before = connection.sock
            response = connection.getresponse()
            answers.append((response.status, json.loads(response.read() or b"{}")))
            assert not response.will_close and connection.sock is socket_before, "the server closed the connection"
    finally:
        connection.close()
    return answers
