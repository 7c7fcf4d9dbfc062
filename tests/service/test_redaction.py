"""Client messages never name the server's directories: a model missing from the hub cache fails with a message
that says where to look in words (<hub cache>), for the synchronous analysis and for a job's worker alike."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from service.config import Settings
from service.workers.child import child_main
from service.workers.messages import Failed
from tests.service_helpers import live_app


def test_the_api_names_no_server_directory(tmp_path: Path) -> None:
    cache = tmp_path / "server-secret-cache"
    settings = Settings(data_dir=tmp_path / "data", hf_cache=cache, hf_offline=True, auth_disabled=True, workers=0)
    with live_app(settings) as client:
        answer = client.post("/v1/analyze", json={"model": "org/absent"})
    assert answer.status_code == 422, answer.text
    message = answer.json()["error"]["message"]
    assert "not in the HF cache (<hub cache>)" in message and str(tmp_path) not in message


def test_a_failed_job_names_no_server_directory(tmp_path: Path) -> None:
    cache, data = tmp_path / "server-secret-cache", tmp_path / "data"
    out = data / "jobs" / "j1" / "attempt-1"
    out.parent.mkdir(parents=True)
    sources = Settings(data_dir=data, hf_cache=cache, hf_offline=True).model_sources()
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    stop = context.Event()  # held here until the child has started: it unpickles the semaphore by name
    child = context.Process(target=child_main, args=({"model": "org/absent"}, str(out), sources, sender, stop,
                                                     os.getpid(), 1))
    child.start()
    sender.close()
    messages = []
    while True:
        try:
            messages.append(receiver.recv())
        except EOFError:
            break
    child.join(60)
    failed = [message for message in messages if isinstance(message, Failed)]
    assert len(failed) == 1 and failed[0].code == "model_not_found", messages
    assert "<hub cache>" in failed[0].message and str(tmp_path) not in failed[0].message, failed[0].message
