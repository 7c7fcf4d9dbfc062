"""A preloaded Python for tests that start many processes of the project: each :meth:`Zygote.start` forks a process
from one that imported torch, transformers' Llama and the conversion pipeline once, and runs a module, script or
code string in it as ``python -m MODULE`` / ``python SCRIPT`` / ``python -c CODE`` would, with the given
arguments, environment, working directory and output file.

Why: a fresh interpreter of this project spends seconds of CPU importing torch and transformers' modeling stack
before the first line of its own code, and the distributed tests start many ranks each, so imports were most of
their CPU (docs/benchmarks/test-suite-2026-12-04g.md has the figures). The forked process runs the same entry point
with the same argv and environment; what is shared is the import, as the service's own fork server shares it for its
jobs (service.workers.task_server). Libraries read a few variables once at import (OpenMP its thread count): the
zygote starts with the environment its users run with, and a child's ``OMP_NUM_THREADS`` is applied to torch. A test
that must see a fresh interpreter (its imports, its start-up) starts one with subprocess.

Protocol: one Unix-socket connection per process; the request is a JSON line; the answer is the process's pid,
then its exit code (negative: the signal that ended it), one line each. A per-request waiter (a fork of the
zygote) forks the process and waits for it, so the zygote itself only accepts (and reaps its waiters).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_PRELOAD", "ForkedProcess", "Zygote"]

ROOT = Path(__file__).resolve().parents[1]
#: what a conversion process of the project imports before its first step
DEFAULT_PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "converters.distributed",
                   "converters.pipeline.driver", "converters.model.sources", "safetensors.torch")


class ForkedProcess:
    """The parts of :class:`subprocess.Popen` the tests use: ``pid``, ``wait``, ``poll``, ``returncode``, ``kill``."""

    def __init__(self, conn: socket.socket, args: list[str]) -> None:
        self.args = args
        self._conn, self._buffer = conn, b""
        self.pid = int(self._line(None))
        self.returncode: int | None = None

    def _line(self, timeout: float | None) -> str:
        self._conn.settimeout(timeout)
        while b"\n" not in self._buffer:
            chunk = self._conn.recv(64)  # raises TimeoutError (socket.timeout) past ``timeout``
            if not chunk:
                raise RuntimeError(f"the zygote's waiter for {self.args} closed without an exit code")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = int(self._line(timeout))
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(timeout=0.001)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.returncode is None:
            os.kill(self.pid, signal.SIGKILL)


class Zygote:
    """Start with the environment the processes share (``env``); :meth:`close` ends it (processes still running
    go on to their end)."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = DEFAULT_PRELOAD, timeout: float = 300) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="zygote-")
        self.socket_path = str(Path(self._dir.name) / "socket")
        self._server = subprocess.Popen([sys.executable, "-m", "tests.zygote", self.socket_path, *preload], cwd=ROOT,
                                        env=env, stdout=subprocess.PIPE, text=True)
        ready = self._server.stdout.readline() if self._server.stdout else ""
        if ready.strip() != "ready":
            self.close()
            raise RuntimeError(f"the zygote did not start (exit {self._server.poll()}): {ready!r}")

    def start(self, args: list[str], *, env: dict[str, str], cwd: Path, output: Path) -> ForkedProcess:
        """``args`` as after ``python``: ``["-m", MODULE, ...]``, ``["-c", CODE, ...]`` or ``[SCRIPT, ...]``;
        stdout and stderr go to ``output`` (created or truncated)."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket_path)
        request = {"args": args, "env": env, "cwd": str(cwd), "output": str(output)}
        conn.sendall(json.dumps(request).encode() + b"\n")
        return ForkedProcess(conn, [sys.executable, *args])

    def close(self) -> None:
        if self._server.poll() is None:
            self._server.terminate()
            try:
                self._server.wait(90)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        self._dir.cleanup()


def _run(request: dict[str, Any]) -> None:
    """In the forked process: become ``python ARGS`` in the request's directory and environment; never returns."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    output = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    stdin = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((stdin, 0), (output, 1), (output, 2)):
        os.dup2(fd, target)
    os.close(output)
    os.close(stdin)
    if "OMP_NUM_THREADS" in os.environ and "torch" in sys.modules:  # OpenMP read the zygote's at import
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    args, code = request["args"], 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 (python -c)
        else:
            sys.argv = list(args)
            sys.path[0] = str(Path(args[0]).resolve().parent)  # as python SCRIPT sets it
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, int | None):
            print(exit_.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (as the interpreter reports an uncaught exception)
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what an interpreter runs at exit, without tearing down the zygote's copy of it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _waiter(conn: socket.socket) -> None:
    """A fork of the zygote for one request: forks the process, answers its pid, waits, answers its exit code."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the zygote's own stop; the process dies of SIGTERM as python does
    conn.settimeout(None)
    with conn.makefile("rb") as lines:
        request = json.loads(lines.readline())
    pid = os.fork()
    if pid == 0:
        conn.close()
        _run(request)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
    os._exit(0)


def _reap(block: bool) -> None:
    """Wait for finished waiters: reaped here (not left to SIGCHLD's SIG_IGN), their processes' CPU seconds count
    in the zygote's children and so in its starter's (tests/scheduling.py's per-file CPU)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def serve(socket_path: str, preload: list[str]) -> None:
    from converters.frozen_imports import imports_frozen

    with imports_frozen():  # as the service's fork server imports: each fork's collections skip what it imported
        for name in preload:
            importlib.import_module(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(socket_path)
    server.listen(64)
    server.settimeout(1.0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("ready", flush=True)
    starter = os.getppid()
    try:
        while os.getppid() == starter:  # a test process that died (no close) leaves no zygote behind
            _reap(block=False)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            if os.fork() == 0:
                server.close()
                _waiter(conn)
            conn.close()
    finally:  # the processes still running end on their own (a test's timeout) before the zygote does
        signal.alarm(60)
        _reap(block=True)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2:])
