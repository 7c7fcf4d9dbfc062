"""One log format for everything `fp8forge serve` logs: uvicorn's start-up and access lines carry the same timestamp,
level and process tag as fp8forge's own (an operator greps one format, and every line says when)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx

from tests.service_helpers import api_client, fp8forge_command, free_port, stop_process, wait_for

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \[api\] [\w.]+: ")


def _answers(client: httpx.Client) -> bool:
    try:
        return client.get("/healthz").status_code == 200
    except httpx.TransportError:
        return False


def test_serve_writes_access_lines_in_the_one_tagged_timestamped_format(tmp_path: Path) -> None:
    port, log = free_port(), tmp_path / "serve.log"
    env = {**os.environ, "FP8FORGE_DATA_DIR": str(tmp_path / "data"), "FP8FORGE_AUTH_DISABLED": "1",
           "FP8FORGE_HF_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
    with log.open("ab") as out:
        proc = subprocess.Popen([*fp8forge_command(), "serve", "--port", str(port), "--workers", "0",
                                 "--log-level", "info"], env=env, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
    try:
        with api_client(f"http://127.0.0.1:{port}") as client:
            wait_for(lambda: _answers(client), timeout=60, what=f"fp8forge serve\n{log.read_text()}")
            assert client.get("/v1/jobs?limit=3").status_code == 200
    finally:
        stop_process(proc)
    lines = log.read_text().splitlines()
    assert [line for line in lines if not LINE.match(line)] == [], "\n".join(lines)
    access = [line for line in lines if "GET /v1/jobs?limit=3" in line]
    assert len(access) == 1 and " INFO [api] uvicorn.access: " in access[0], lines
    assert any(" [api] uvicorn.error: " in line and "Uvicorn running on" in line for line in lines), lines
