"""Several processes opening the store at once on a fresh PostgreSQL schema (an API and its workers starting
together) all start: the tables are created under an advisory lock, by whichever comes first."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from service.store import JobStore
from tests.service_helpers import postgres_url, wait_for

pytestmark = pytest.mark.postgres

PROCESSES = 5
# Each process imports first and reports ready, then waits for the go file, so all of them open the store at once.
OPEN_AT_ONCE = """
import sys, time
from pathlib import Path
from service.store import JobStore
url, prefix, ready, go = sys.argv[1:]
Path(ready).touch()
while not Path(go).exists():
    time.sleep(0.001)
JobStore(url, table_prefix=prefix).close()
"""


def test_processes_opening_a_fresh_store_at_once_all_start(tmp_path: Path) -> None:
    url = postgres_url()
    if url is None:
        pytest.skip("PostgreSQL is not reachable on 127.0.0.1:5432")
    prefix = f"t{uuid.uuid4().hex[:12]}_"
    go = tmp_path / "go"
    ready = [tmp_path / f"ready-{n}" for n in range(PROCESSES)]
    procs = [subprocess.Popen([sys.executable, "-c", OPEN_AT_ONCE, url, prefix, str(mark), str(go)],
                              cwd=Path(__file__).parents[3], stderr=subprocess.PIPE, text=True) for mark in ready]
    try:
        wait_for(lambda: all(mark.exists() for mark in ready), timeout=60, what="every process to import")
        time.sleep(0.1)
        go.touch()
        failures = [(p.wait(60), p.stderr.read()[-2000:]) for p in procs]
        assert [f for f in failures if f[0] != 0] == []
        store = JobStore(url, table_prefix=prefix)
        job, _ = store.create_job({"model": "demo/tiny-llama"}, request_hash="h")
        assert store.claim_next("w").id == job.id  # one complete schema
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        JobStore(url, table_prefix=prefix).drop_all()
