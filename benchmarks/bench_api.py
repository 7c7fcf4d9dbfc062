"""The HTTP API under load next to /healthz, a conversion's calibration with and without that load, downloads.

One run against a real `fp8forge serve` (one local worker, its own temporary data dir, FP8FORGE_AUTH_DISABLED=1,
127.0.0.1), loaded with wrk (https://github.com/wg/wrk; `apt-get install wrk`): a C load generator with
keep-alive connections and latency percentiles, the tool the issue's figures were taken with. One wrk thread
(`--wrk-threads`) drives far more requests than the server answers and leaves the other cores to the server
and the conversion, which matters on a small machine.

  API          GET /healthz, GET /v1/jobs/{id} (a status poll) and GET /v1/jobs (the list: `--jobs` finished
               jobs and the benchmark's own) at 1, 16 and 64 connections, `--duration` seconds each: idle (the
               poll asks for a finished job), then while a conversion of demo/tiny-llama calibrates (the poll
               asks for that running job; jobs queued one after another keep one calibrating, a run whose job
               left the calibrate stage meanwhile is repeated, and one marked `*` never fit in one). /healthz is
               the service's own liveness route, a plain `def` that FastAPI runs in its threadpool (on purpose:
               see service/api/routes/health.py); the poll reads a SQLite store on the event loop. An `async`
               /healthz, which skips that hop, served about 5400 req/s here against the poll's 3100.
  calibration  steps per second of the calibrate stage (`--steps` batches of 2 x 128 tokens / the stage's
               seconds between its `stage` events): alone, and with 64 connections polling the job's status
               from its submission to the end of the stage; `--repeats` of each, interleaved, the median shown
               with the CPU the conversion and the API used meanwhile.
  download     an artifact of `--download-mib` MiB through GET /v1/jobs/{id}/artifacts/{name}, next to reading
               the same file, and next to the same bytes sent from memory by a bare socket loop in another
               process (no disk, no HTTP: what TCP on loopback carries here). One loop of 1 MiB reads consumes
               all three, so the ratios are what the download costs a reader (curl, reading 16 KiB at a time,
               would measure itself). "warm": the file in the page cache, best of 3; "cold": its pages dropped
               (posix_fadvise DONTNEED) before each read, best of 2.

Targets (printed beside the measured ratios; a missed target never changes the exit status):
  poll / healthz requests per second at 64 connections       >= 0.8 (idle and during the conversion)
  calibration steps per second under the poll load / alone   >= 0.7
  download / bare loopback TCP carrying the same bytes       >= 0.8 (warm: the file in the page cache; TCP is the
                                                                     ceiling any server has here, and a warm file
                                                                     read outruns it, so it is the measure, not disk)
  download / disk read, cold                                 >= 0.5 (the file's pages dropped before each read)

The finished jobs (the listed ones and the one holding the download's artifact) are written through the job
store before the server starts, so no worker ever sees them queued. About four minutes on 2 cores.

Run: .venv/bin/python benchmarks/bench_api.py [--duration 4] [--steps 1024] [--conversion-threads N]
                                              [--parts idle,calibration,busy,download]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
CONNECTIONS = (1, 16, 64)
PARTS = ("idle", "calibration", "busy", "download")
DEMO = "demo/tiny-llama"
# wrk's `done` hook: one line of JSON instead of its human summary, which changes units as numbers grow
WRK_SCRIPT = """
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format('WRK-JSON {"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, '
    .. '"errors": %d, "non2xx": %d}\\n', summary.requests, summary.duration, latency:percentile(50),
    latency:percentile(99), e.connect + e.read + e.write + e.timeout, e.status))
end
"""


class Serve:
    """`fp8forge serve` with one worker in ``data_dir`` on a free loopback port."""

    def __init__(self, data_dir: Path, env: dict[str, str]) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = data_dir.parent / "serve.log"
        # `-m` from the repository root: the server runs this checkout's code, whatever the venv installed
        self.argv = [sys.executable, "-m", "service.cli.main", "serve", "--host", "127.0.0.1",
                     "--port", str(self.port), "--workers", "1"]
        self.env = {**os.environ, "FP8FORGE_DATA_DIR": str(data_dir), "FP8FORGE_AUTH_DISABLED": "1",
                    "HF_HUB_OFFLINE": "1", "FP8FORGE_HF_OFFLINE": "1", "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1",
                    **env}
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=self.base, timeout=60)

    def __enter__(self) -> Serve:
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"fp8forge serve did not start:\n{self.log.read_text()[-3000:]}")
            try:
                if self.client.get("/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def submit(self, steps: int, batch_size: int = 2) -> str:
        body = {"model": DEMO, "recipe": {"backend": "ao"}, "calibration": {"steps": steps, "batch_size": batch_size}}
        response = self.client.post("/v1/jobs", json=body)
        if response.status_code != 202:
            raise SystemExit(f"submitting a job failed: {response.status_code} {response.text}")
        return response.json()["id"]

    def job(self, job_id: str) -> dict[str, Any]:
        return self.client.get(f"/v1/jobs/{job_id}").json()

    def wait(self, job_id: str, until: Any, *, timeout: float = 600) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while not until(job := self.job(job_id)):
            if time.monotonic() > deadline:
                raise SystemExit(f"job {job_id} still {job['status']}/{job['stage']} after {timeout}s\n"
                                 f"{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        return job

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the API (this server's own process) and of the conversion (its workers' children)."""
        assert self.proc is not None
        workers = [pid for pid in _children(self.proc.pid) if b"resource_tracker" not in _cmdline(pid)]
        conversion = sum(_cpu_seconds(pid) for worker in workers for pid in _children(worker))
        return {"api": _cpu_seconds(self.proc.pid), "conversion": conversion}

    def stage_seconds(self, job_id: str, stage: str) -> float:
        """Seconds between the ``stage`` event of ``stage`` and the event that ended it (the job has finished)."""
        marks: list[tuple[str, float]] = []
        kind = ""
        with self.client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=120) as response:
            for line in response.iter_lines():
                if line.startswith("event: "):
                    kind = line[len("event: "):]
                elif line.startswith("data: "):
                    data = json.loads(line[len("data: "):])
                    at = datetime.fromisoformat(data["at"]).timestamp()
                    if kind == "stage" or (kind == "status" and marks):
                        marks.append((data.get("stage", data.get("status")), at))
        for (name, start), (_, end) in zip(marks, marks[1:], strict=False):
            if name == stage:
                return end - start
        raise SystemExit(f"job {job_id} has no finished {stage!r} stage in its events: {marks}")


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(child) for child in (task / "children").read_text().split()]
    return found


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # it ended
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Wrk:
    """One wrk run; either for a fixed duration (:meth:`run`) or until :meth:`stop` (SIGINT, wrk then reports)."""

    def __init__(self, script: Path, threads: int) -> None:
        self.script, self.threads = script, threads
        self.proc: subprocess.Popen[str] | None = None

    def start(self, url: str, connections: int, duration_s: float) -> None:
        threads = min(self.threads, connections)
        self.proc = subprocess.Popen(
            ["wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, round(duration_s))}s", "--timeout", "10s",
             "-s", str(self.script), url], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stop(self) -> dict[str, float]:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        out, _ = self.proc.communicate()
        line = next((x for x in out.splitlines() if x.startswith("WRK-JSON ")), None)
        if line is None:
            raise SystemExit(f"wrk printed no summary:\n{out}")
        raw = json.loads(line[len("WRK-JSON "):])
        return {"rps": raw["requests"] / (raw["duration_us"] / 1e6), "p50_ms": raw["p50_us"] / 1e3,
                "p99_ms": raw["p99_us"] / 1e3, "errors": raw["errors"] + raw["non2xx"]}

    def run(self, url: str, connections: int, duration_s: float) -> dict[str, float]:
        self.start(url, connections, duration_s)
        assert self.proc is not None
        self.proc.wait()
        return self.stop()


def seed_store(data_dir: Path, listed: int, artifact_bytes: int) -> tuple[str, Path]:
    """Finished jobs written through the job store before the server runs; returns the artifact's job and file."""
    sys.path.insert(0, str(ROOT))
    from service.artifacts import ArtifactDirs
    from service.config import Settings
    from service.jobs import JobStatus
    from service.store import JobStore

    settings = Settings(data_dir=data_dir)
    store, dirs = JobStore(settings.store_url), ArtifactDirs(settings.jobs_dir)
    dirs.ensure()
    try:
        for n in range(listed + 1):
            job, _ = store.create_job({"model": DEMO, "recipe": {"backend": "ao"}}, request_hash=uuid.uuid4().hex)
            store.claim_next("bench-seed")
            files = ()
            if n == listed:  # the last one holds the download's artifact
                final = dirs.final_dir(job.id)
                final.mkdir(parents=True)
                _write_random(final / "model.safetensors", artifact_bytes)
                files = dirs.index(job.id)
            store.set_status(job.id, JobStatus.SUCCEEDED, owner="bench-seed", artifacts=files)
    finally:
        store.close()
    return job.id, dirs.final_dir(job.id) / "model.safetensors"


def _write_random(path: Path, size: int) -> None:
    block = os.urandom(1 << 20)
    with path.open("wb") as fh:
        for _ in range(size >> 20):
            fh.write(block)
        os.fsync(fh.fileno())


def api_table(serve: Serve, wrk: Wrk, duration: float, poll_target: Callable[[], str],
              calibrating: Callable[[str], bool] | None = None) -> list[dict]:
    """wrk on healthz, the poll of ``poll_target()`` and the list at each connection count.

    With ``calibrating``, a run whose job left the calibrate stage meanwhile is run again (twice at most, then
    flagged): the busy table is measured beside calibration only.
    """
    rows = []
    for connections in CONNECTIONS:
        for name in ("healthz", "poll", "list"):
            for _ in range(3):
                job_id = poll_target()
                path = {"healthz": "/healthz", "poll": f"/v1/jobs/{job_id}", "list": "/v1/jobs"}[name]
                measured = wrk.run(serve.base + path, connections, duration)
                row = {"endpoint": name, "connections": connections, **measured}
                row["outlived"] = calibrating is not None and not calibrating(job_id)
                if not row["outlived"]:
                    break
            rows.append(row)
    return rows


class CalibratingJobs:
    """Keeps a conversion in its calibrate stage: jobs queued one after another for the one worker (a job may
    hold only so many calibration tokens, fewer than the busy table takes to measure)."""

    def __init__(self, serve: Serve, steps: int, batch_size: int) -> None:
        self.serve, self.steps, self.batch_size = serve, steps, batch_size
        self.ids: list[str] = []

    def current(self) -> str:
        """The job calibrating now, waiting for the next one when none is (with two queued or running)."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            live = [j for j in map(self.serve.job, self.ids) if j["status"] in ("queued", "running")]
            if len(live) < 2:
                self.ids.append(self.serve.submit(self.steps, self.batch_size))
                continue
            calibrating = [j["id"] for j in live if j["status"] == "running" and j["stage"] == "calibrate"]
            if calibrating:
                return calibrating[0]
            time.sleep(0.1)
        raise SystemExit(f"no job reached its calibrate stage in 300 s\n{self.serve.log.read_text()[-3000:]}")

    def still(self, job_id: str) -> bool:
        job = self.serve.job(job_id)
        return job["status"] == "running" and job["stage"] == "calibrate"

    def cancel_all(self) -> None:
        for job_id in self.ids:
            self.serve.client.post(f"/v1/jobs/{job_id}/cancel")  # 409 for a finished one: fine


def calibration_rate(serve: Serve, steps: int, wrk: Wrk | None) -> dict[str, Any]:
    """One job's calibrate stage: steps per second and the CPU its processes used meanwhile (in CPUs); with
    ``wrk``, 64 connections poll the job from its submission to the end of the stage."""
    job_id = serve.submit(steps)
    if wrk is not None:
        wrk.start(f"{serve.base}/v1/jobs/{job_id}", 64, 3600)
    try:
        serve.wait(job_id, lambda j: j["stage"] == "calibrate" or j["status"] not in ("queued", "running"))
        before, start = serve.cpu_seconds(), time.monotonic()
        serve.wait(job_id, lambda j: j["stage"] != "calibrate" or j["status"] != "running")
        after, wall = serve.cpu_seconds(), time.monotonic() - start
    finally:
        load = wrk.stop() if wrk is not None else None
    final = serve.wait(job_id, lambda j: j["status"] in ("succeeded", "failed", "cancelled"))
    if final["status"] != "succeeded":
        raise SystemExit(f"calibration job {job_id} ended {final['status']}: {final['error']}")
    cpu = {part: (after[part] - before.get(part, 0.0)) / wall for part in after}
    return {"rate": steps / serve.stage_seconds(job_id, "calibrate"), "load": load, "cpu": cpu}


def download_rates(base: str, job_id: str, path: Path) -> dict[str, dict[str, float]]:
    """Bytes per second of one loop of 1 MiB reads from ``path``, from the API's download of it, and from the
    file's bytes sent from memory by a bare socket loop (what TCP on loopback carries here, with no disk).

    The same loop reads every source, so the ratios are what the HTTP download costs a reader; a client such
    as curl reads in 16 KiB pieces and would measure itself rather than the server. "warm": the file is in the
    page cache, best of 3; "cold": its pages are dropped (posix_fadvise DONTNEED) before each read, best of 2.
    """
    host, port = base.removeprefix("http://").split(":")
    with _TcpCeiling(path) as ceiling:
        sources = {
            "disk": lambda buffer: _read_file(path, buffer),
            "api": lambda buffer: _read_http(host, int(port), f"/v1/jobs/{job_id}/artifacts/{path.name}", buffer),
            "tcp": lambda buffer: _read_http(host, ceiling.port, "/", buffer),
        }
        rates: dict[str, dict[str, float]] = {"warm": {}, "cold": {}}
        buffer = bytearray(1 << 20)
        for cache, tries in (("warm", 3), ("cold", 2)):
            for _ in range(tries):
                for name, read in sources.items():
                    if cache == "cold":
                        _drop_from_page_cache(path)
                    start = time.perf_counter()
                    got = read(buffer)
                    if got != path.stat().st_size:
                        raise SystemExit(f"{name} gave {got} bytes of {path.stat().st_size}")
                    rate = got / (time.perf_counter() - start)
                    rates[cache][name] = max(rates[cache].get(name, 0.0), rate)
    return rates


def _read_file(path: Path, buffer: bytearray) -> int:
    total = 0
    with path.open("rb", buffering=0) as fh:
        while n := fh.readinto(buffer):
            total += n
    return total


def _read_http(host: str, port: int, target: str, buffer: bytearray) -> int:
    """GET ``target`` over a fresh connection; the number of body bytes received (the status must be 200)."""
    view = memoryview(buffer)
    with socket.create_connection((host, port)) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            n = sock.recv_into(view)
            if not n:
                raise SystemExit(f"GET {target}: the connection closed inside the headers")
            head += bytes(view[:n])
        if not head.startswith(b"HTTP/1.1 200"):
            raise SystemExit(f"GET {target}: {head[:200]!r}")
        total = len(head) - head.index(b"\r\n\r\n") - 4
        while n := sock.recv_into(view):
            total += n
    return total


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages would stay
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_TCP_SERVER = """
import socket, sys
data = memoryview(open(sys.argv[1], "rb").read())
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
head = f"HTTP/1.1 200 OK\\r\\nContent-Length: {len(data)}\\r\\nConnection: close\\r\\n\\r\\n".encode()
while True:
    conn, _ = server.accept()
    with conn:
        conn.recv(65536)
        conn.sendall(head)
        for start in range(0, len(data), 1 << 20):
            conn.sendall(data[start:start + (1 << 20)])
"""


class _TcpCeiling:
    """A process answering every connection with the file's bytes, held in memory: no disk, no HTTP server."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _TCP_SERVER, str(path)], stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def __enter__(self) -> _TcpCeiling:
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.kill()
        self.proc.wait()


def print_api(title: str, rows: list[dict]) -> None:
    print(f"\n{title}")
    print(f"{'endpoint':<9}{'conns':>6}{'req/s':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}")
    for r in rows:
        mark = " *" if r.get("outlived") else ""
        print(f"{r['endpoint']:<9}{r['connections']:>6}{r['rps']:>9.0f}{r['p50_ms']:>9.1f}{r['p99_ms']:>9.1f}"
              f"{r['errors']:>8}{mark}")


def download_ratios(rates: dict[str, dict[str, float]]) -> list[tuple[str, float, float]]:
    """(label, measured, target) of the download: against bare loopback TCP (warm) and a cold disk read."""
    return [("download / bare loopback TCP, same bytes (warm)", rates["warm"]["api"] / rates["warm"]["tcp"], 0.8),
            ("download / disk read, cold", rates["cold"]["api"] / rates["cold"]["disk"], 0.5)]


def poll_ratio(rows: list[dict], connections: int = 64) -> float:
    rate = {r["endpoint"]: r["rps"] for r in rows if r["connections"] == connections}
    return rate["poll"] / rate["healthz"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=4.0, help="seconds per wrk run (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=1024, help="calibration steps (batches of 2 x 128 tokens) "
                        "of the timed jobs (default: %(default)s, the most a job may ask for)")
    parser.add_argument("--repeats", type=int, default=3, help="calibration runs of each kind; the median is shown")
    parser.add_argument("--busy-batch-size", type=int, default=4, help="calibration batch size of the jobs the busy "
                        "table runs beside (default: %(default)s: twice the tokens, the most a job may hold)")
    parser.add_argument("--jobs", type=int, default=20, help="finished jobs in the store for the list")
    parser.add_argument("--download-mib", type=int, default=256, help="size of the downloaded artifact")
    parser.add_argument("--wrk-threads", type=int, default=1)
    parser.add_argument("--conversion-threads", type=int, default=None,
                        help="FP8FORGE_CONVERSION_THREADS for the server (default: the server's own default)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {','.join(PARTS)} (default: all)")
    args = parser.parse_args()
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    if not parts <= set(PARTS):
        parser.error(f"--parts takes {', '.join(PARTS)}")
    if shutil.which("wrk") is None:
        raise SystemExit("bench_api needs wrk on PATH (Debian/Ubuntu: apt-get install -y wrk)")
    env = {} if args.conversion_threads is None else {"FP8FORGE_CONVERSION_THREADS": str(args.conversion_threads)}
    print(f"{os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable), load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}; wrk threads {args.wrk_threads}; {args.duration:g} s per "
          f"wrk run; server environment {env or 'default'}")
    with tempfile.TemporaryDirectory(prefix="bench-api-") as temporary:
        data_dir = Path(temporary) / "data"
        download_mib = args.download_mib if "download" in parts else 1
        artifact_job, artifact = seed_store(data_dir, args.jobs, download_mib << 20)
        script = Path(temporary) / "summary.lua"
        script.write_text(WRK_SCRIPT)
        with Serve(data_dir, env) as serve:
            results = run_parts(serve, Wrk(script, args.wrk_threads), parts, args, artifact_job, artifact)
    report(results, args)


def run_parts(serve: Serve, wrk: Wrk, parts: set[str], args: argparse.Namespace, artifact_job: str,
              artifact: Path) -> dict[str, Any]:
    started = time.monotonic()
    results: dict[str, Any] = {}
    if "idle" in parts:  # the poll asks for a finished job
        results["idle"] = api_table(serve, wrk, args.duration, lambda: artifact_job)
    if parts & {"calibration", "busy"}:
        warm = serve.submit(1)  # builds the demo model once; every later job finds it
        serve.wait(warm, lambda j: j["status"] == "succeeded")
    if "calibration" in parts:
        runs: dict[str, list[dict[str, Any]]] = {"alone": [], "loaded": []}
        for _ in range(args.repeats):  # interleaved, so a change in the machine's other load hits both alike
            runs["alone"].append(calibration_rate(serve, args.steps, None))
            runs["loaded"].append(calibration_rate(serve, args.steps, wrk))
        for kind, measured in runs.items():
            results[kind] = sorted(measured, key=lambda r: r["rate"])[len(measured) // 2]  # the median run
    if "busy" in parts:
        jobs = CalibratingJobs(serve, args.steps, args.busy_batch_size)
        try:
            results["busy"] = api_table(serve, wrk, args.duration, jobs.current, jobs.still)
        finally:
            jobs.cancel_all()
    if "download" in parts:
        results["download"] = download_rates(serve.base, artifact_job, artifact)
    results["elapsed"] = time.monotonic() - started
    return results


def report(results: dict[str, Any], args: argparse.Namespace) -> None:
    ratios = []
    if "idle" in results:
        print_api("idle (the poll asks for a finished job)", results["idle"])
        ratios.append(("poll / healthz req/s, 64 connections, idle", poll_ratio(results["idle"]), 0.8))
    if "busy" in results:
        print_api("during a conversion's calibrate stage (the poll asks for the running job)", results["busy"])
        ratios.append(("poll / healthz req/s, 64 connections, calibrating", poll_ratio(results["busy"]), 0.8))
    if "alone" in results:
        alone, loaded = results["alone"], results["loaded"]
        print(f"\ncalibration, {args.steps} steps, median of {args.repeats} (the CPU used meanwhile, in CPUs of the "
              f"{len(os.sched_getaffinity(0))} here)")
        for label, r in (("alone", alone), ("64 connections polling", loaded)):
            poll = f"; the poll {r['load']['rps']:.0f} req/s, p99 {r['load']['p99_ms']:.1f} ms" if r["load"] else ""
            print(f"  {label:<24}{r['rate']:7.1f} steps/s   conversion {r['cpu']['conversion']:.2f}, "
                  f"API {r['cpu']['api']:.2f}{poll}")
        ratios.append(("calibration steps/s under 64-connection poll / alone", loaded["rate"] / alone["rate"], 0.7))
    if "download" in results:
        rates = results["download"]
        print(f"\ndownload of {args.download_mib} MiB, MiB/s (one loop of 1 MiB reads; tcp: the same bytes from memory "
              "through a bare socket, the most loopback TCP carries here)")
        print(f"{'':<6}{'disk':>8}{'api':>8}{'tcp':>8}{'api/disk':>10}{'api/tcp':>9}{'tcp/disk':>10}")
        for cache, r in rates.items():  # tcp/disk: the most api/disk any server could reach over loopback here
            print(f"{cache:<6}{r['disk'] / 2**20:>8.0f}{r['api'] / 2**20:>8.0f}{r['tcp'] / 2**20:>8.0f}"
                  f"{r['api'] / r['disk']:>10.2f}{r['api'] / r['tcp']:>9.2f}{r['tcp'] / r['disk']:>10.2f}")
        ratios += download_ratios(rates)
    print(f"\nratios (measured in {results['elapsed']:.0f} s):")
    for label, value, target in ratios:
        print(f"  {label:<54}{value:5.2f}  (target >= {target})")


if __name__ == "__main__":
    main()
