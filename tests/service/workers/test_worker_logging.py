"""What operators read: the logs of `fp8forge worker` and `fp8forge serve`, as real processes.

A standalone worker logs timestamped INFO lines (started, claimed, succeeded); ``--log-level`` reaches fp8forge's
own loggers in the API, its workers and their conversion children; a demo job leaves no library warning in the
log; a worker stopped inside its success write, whose job went to another worker meanwhile, logs one calm
warning when it is resumed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from service.config import Settings
from service.jobs import JobStatus
from service.store import JobStore
from service.workers.messages import Progress, StageStarted, Succeeded
from service.workers.worker import Worker
from tests.service.workers.test_multi_host import fresh_database
from tests.service_helpers import api_client, fp8forge_command, free_port, stop_process, wait_for

DEMO = {"model": "demo/tiny-llama", "recipe": {"backend": "ao", "recipe_name": "tensorwise"},
        "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}
# one of fp8forge's own log lines: a timestamp, the level, which process, the logger
OWN_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                      r"\[(api|worker|conversion)\] (service|converters)\.[\w.]+: ")


def _env(data_dir: Path, **settings: str) -> dict[str, str]:
    return {**os.environ, "FP8FORGE_DATA_DIR": str(data_dir), "FP8FORGE_HF_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1", "FP8FORGE_POLL_INTERVAL_S": "0.2",
            **{f"FP8FORGE_{k.upper()}": v for k, v in settings.items()}}


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[3])


def _finished(store: JobStore, job_id: str):
    job = store.get_job(job_id)
    return job if job.status.is_finished else None


@pytest.mark.slow
def test_a_standalone_worker_logs_timestamped_info_lines_and_no_library_noise(tmp_path: Path) -> None:
    data = tmp_path / "data"
    store = JobStore(f"sqlite:///{data / 'fp8forge.db'}")
    proc = _start([*fp8forge_command(), "worker"], _env(data), tmp_path / "worker.log")
    try:
        job, _ = store.create_job(DEMO, request_hash="demo")
        done = wait_for(lambda: _finished(store, job.id), timeout=180, what="the demo job")
    finally:
        stop_process(proc)
        store.close()
    log = (tmp_path / "worker.log").read_text()
    assert done.status is JobStatus.SUCCEEDED, log
    lines = log.splitlines()
    assert [line for line in lines if not OWN_LINE.match(line)] == [], "only fp8forge's own, timestamped lines"
    for expected in (r"INFO \[worker\] service\.workers\.worker: worker \S+ started",
                     rf"INFO \[worker\] service\.workers\.worker: job {job.id}: claimed, attempt 1 of 3",
                     r"INFO \[conversion\] converters\.",
                     rf"INFO \[worker\] service\.workers\.worker: job {job.id}: succeeded",
                     r"INFO \[worker\] service\.workers\.worker: worker \S+ stopped"):
        assert any(re.search(expected, line) for line in lines), (expected, log)


@pytest.mark.slow
def test_serve_log_level_reaches_the_api_the_workers_and_their_conversions(tmp_path: Path) -> None:
    data, port = tmp_path / "data", free_port()
    log = tmp_path / "serve.log"
    proc = _start([*fp8forge_command(), "serve", "--port", str(port), "--workers", "1", "--log-level", "warning"],
                  _env(data, auth_disabled="1"), log)
    try:
        with api_client(f"http://127.0.0.1:{port}") as client:
            wait_for(lambda: _answers(client), timeout=60, what=f"fp8forge serve\n{log.read_text()}")
            job = client.post("/v1/jobs", json=DEMO).json()
            done = wait_for(lambda: _finished_json(client, job["id"]), timeout=180, what="the demo job")
    finally:
        stop_process(proc)
    assert done["status"] == "succeeded", log.read_text()
    # nothing below WARNING from fp8forge, and nothing at all from the libraries (torch, torchao, transformers)
    assert log.read_text().splitlines() == []


def test_serve_logs_the_apis_info_lines_with_timestamps(tmp_path: Path) -> None:
    data, port = tmp_path / "data", free_port()
    log = tmp_path / "serve.log"
    proc = _start([*fp8forge_command(), "serve", "--port", str(port), "--workers", "0", "--log-level", "info"],
                  _env(data, auth_disabled="1"), log)
    try:
        with api_client(f"http://127.0.0.1:{port}") as client:
            wait_for(lambda: _answers(client), timeout=60, what=f"fp8forge serve\n{log.read_text()}")
    finally:
        stop_process(proc)
    ready = [line for line in log.read_text().splitlines() if "fp8forge API ready" in line]
    assert len(ready) == 1 and OWN_LINE.match(ready[0]) and " INFO [api] service.main: " in ready[0], ready


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


def _finished_json(client: httpx.Client, job_id: str) -> dict | None:
    job = client.get(f"/v1/jobs/{job_id}").json()
    return job if job["status"] in ("succeeded", "failed", "cancelled") else None


def gated_child(request: dict[str, Any], out_dir: str, sources: dict[str, Any], conn: Any, stop: Any,
                worker_pid: int, **_: Any) -> None:
    """A conversion child that reports every stage and writes its files, then waits for ``request["finish"]``
    before it reports success: the test decides when its worker records the outcome."""
    from service.workers.procs import die_with_worker

    die_with_worker(worker_pid)
    for stage in ("resolve", "analyze", "calibrate", "convert", "export"):
        conn.send(StageStarted(stage))
        conn.send(Progress(1, 1))
    out = Path(out_dir)
    staging = out.parent / f".{out.name}.partial"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(os.urandom(64))
    (staging / "manifest.json").write_text(json.dumps({"files": []}))
    os.replace(staging, out)
    finish = Path(request["finish"])
    while not finish.exists() and not stop.is_set():
        time.sleep(0.02)
    conn.send(Succeeded([]))
    conn.close()


# `fp8forge worker` itself, its conversion child replaced by gated_child
GATED_WORKER = """
import sys
import service.workers.runner
from tests.service.workers.test_worker_logging import gated_child
service.workers.runner.child_main = gated_child
from service.cli.main import main
sys.exit(main(["worker"]))
"""


@pytest.mark.postgres
def test_a_worker_resumed_after_its_job_went_elsewhere_logs_one_calm_warning(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data, log, finish = tmp_path / "data", tmp_path / "stopped-worker.log", tmp_path / "finish"
    timeouts = {"heartbeat_interval_s": "0.2", "heartbeat_timeout_s": "1.5", "store_lock_timeout_s": "5",
                "store_idle_in_transaction_timeout_s": "2"}
    with fresh_database() as db_url:
        store = JobStore(db_url)
        stopped = _start([sys.executable, "-c", GATED_WORKER], _env(data, database_url=db_url, **timeouts), log)
        other_thread = None
        try:
            job, _ = store.create_job({"model": "fake", "finish": str(finish)}, request_hash="h")
            wait_for(lambda: _progress(store, job.id) == "export", timeout=60, what=f"the run\n{log.read_text()}")
            with store.engine.connect() as blocker:
                blocker.begin()
                # the worker's success write will wait inside its transaction, holding the job's row, right here
                blocker.execute(sa.text("LOCK TABLE job_events IN SHARE MODE"))
                finish.touch()
                wait_for(lambda: _waiting_to_record(store), timeout=30, what="the worker's success write")
                os.kill(stopped.pid, signal.SIGSTOP)  # stopped inside its success transaction
                blocker.rollback()
            # the server ends the stopped worker's idle session; another worker gets the job and finishes it
            monkeypatch.setattr("service.workers.runner.child_main", gated_child)
            other = Worker(Settings(data_dir=data, database_url=db_url, heartbeat_interval_s=0.2,
                                    heartbeat_timeout_s=1.5, poll_interval_s=0.1))
            other_thread = threading.Thread(target=other.run, daemon=True)
            other_thread.start()
            done = wait_for(lambda: _finished(store, job.id), timeout=60, what="the other worker to finish the job")
            assert done.status is JobStatus.SUCCEEDED and done.attempt == 2 and done.worker_id == other.worker_id
            published = sorted(p.name for p in (data / "jobs" / job.id).iterdir())

            before = log.read_text()
            os.kill(stopped.pid, signal.SIGCONT)
            wait_for(lambda: f"job {job.id}: lost" in log.read_text(), timeout=30,
                     what=f"the resumed worker to give the job up\n{log.read_text()}")
            after = log.read_text()[len(before):]
        finally:
            if stopped.poll() is None:
                os.kill(stopped.pid, signal.SIGCONT)
            stop_process(stopped)
            if other_thread is not None:
                other.stop()
                other_thread.join(30)
            store.close()
    warnings = [line for line in after.splitlines() if " WARNING " in line]
    assert len(warnings) == 1 and job.id in warnings[0] and "another" in warnings[0], after
    assert " ERROR " not in after and "Traceback" not in after, after
    assert [line for line in after.splitlines() if not OWN_LINE.match(line)] == [], after  # one line each
    # the resumed worker left the files the other one published where they are
    assert sorted(p.name for p in (data / "jobs" / job.id).iterdir()) == published


def _progress(store: JobStore, job_id: str) -> str | None:
    """The stage of the job's last progress event once the stage is complete."""
    done = [e.data["stage"] for e in store.events.after(job_id) if e.kind == "progress" and e.data["done"] == 1]
    return done[-1] if done else None


def _waiting_to_record(store: JobStore) -> bool:
    query = sa.text("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query ILIKE 'INSERT INTO job_events%VALUES%'")
    with store.engine.connect() as conn:
        return conn.execute(query).scalar() > 0
