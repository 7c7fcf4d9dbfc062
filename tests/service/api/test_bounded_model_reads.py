"""POST /v1/jobs reads a client's model directory within bounds, and not in the API process: a sparse 1 GiB index
(with an include pattern, which reads it), a config.json of exactly the 16 MiB limit made of 5.5 million empty
lists, and a 97 MB safetensors header of 1.4 million tensors are each refused with 422 invalid_model_config naming
the file and the limit, while the API's memory stays flat and /healthz answers at once. They took the API from
301 MB to 2.35 GB, and 16 s and 1.16 GB per request, with /healthz stalled for seconds.

A real `fp8forge serve` on loopback (its own process, so its memory is the API's alone), real HTTP clients."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from converters.model.limits import MAX_CONFIG_BYTES
from tests.converters.model.test_config_limits import TINY
from tests.converters.modelfree.test_header_limits import write_many_tensors
from tests.service_helpers import ServeProcess

#: The API's memory may grow this much over the three requests (it grew by 1-2 GB); the checks run elsewhere.
RSS_GROWTH_BYTES = 100 << 20
#: Each /healthz answer while the requests run: milliseconds on a quiet host, seconds while the API parsed.
HEALTHZ_S = 0.2


def _sparse_index(model: Path) -> Path:
    (model / "config.json").write_text(json.dumps(TINY))
    with open(model / "model.safetensors.index.json", "wb") as handle:
        handle.write(b'{"weight_map": {"model.layers.0.mlp.up_proj.weight": "model.safetensors"')
        handle.truncate(1 << 30)
    return model


def _config_of_empty_lists(model: Path) -> Path:
    head, tail = json.dumps(TINY)[:-1] + ', "x": [', "]}"
    count = (MAX_CONFIG_BYTES - len(head) - len(tail) + 1) // 3
    text = head + ",".join(["[]"] * count) + tail
    text = text.replace('"x": [', '"x": [' + " " * (MAX_CONFIG_BYTES - len(text)), 1)
    (model / "config.json").write_text(text)
    assert (model / "config.json").stat().st_size == MAX_CONFIG_BYTES
    return model


def _many_tensors(model: Path) -> Path:
    (model / "config.json").write_text(json.dumps(TINY))
    write_many_tensors(model / "model.safetensors", 1_400_000)
    return model


CASES = {"sparse-index": (_sparse_index, "model.safetensors.index.json is larger than 64 MiB"),
         "empty-lists": (_config_of_empty_lists, "config.json holds about"),
         "many-tensors": (_many_tensors, "weight file 'model.safetensors'")}


def _memory(pid: int) -> dict[str, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) * 1024 for name in ("VmRSS", "VmHWM")}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bounded") / "models"
    for name, (make, _) in CASES.items():
        (root / name).mkdir(parents=True)
        make(root / name)
    return root


def test_hostile_model_files_are_refused_with_flat_api_memory_and_healthz_answering(models: Path) -> None:
    env = {"FP8FORGE_ALLOWED_MODEL_ROOTS": str(models)}
    with ServeProcess(models.parent / "data", workers=0, env=env) as server, server.client() as client:
        # a first check starts the check processes; the API's own memory is measured from here
        assert client.post("/v1/jobs", json={"model": str(models / "sparse-index"),
                                             "recipe": {"backend": "ao"}}).status_code == 202
        pid = server.proc.pid
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM: the peak from now on
        before = _memory(pid)["VmRSS"]
        answers: dict[str, tuple[float, httpx.Response]] = {}

        def post(name: str) -> None:
            body = {"model": str(models / name), "recipe": {"backend": "ao"}, "include": ["layers.0.mlp"]}
            started = time.monotonic()
            with server.client() as own:
                answer = own.post("/v1/jobs", json=body, timeout=300)
            answers[name] = (time.monotonic() - started, answer)

        threads = [threading.Thread(target=post, args=(name,)) for name in CASES]
        for thread in threads:
            thread.start()
        health = []
        while any(thread.is_alive() for thread in threads) or len(health) < 20:
            started = time.monotonic()
            assert client.get("/healthz").status_code == 200
            health.append(time.monotonic() - started)
            time.sleep(0.02)
        for thread in threads:
            thread.join()
        growth = _memory(pid)["VmHWM"] - before

    for name, (_, words) in CASES.items():
        elapsed, answer = answers[name]
        assert answer.status_code == 422, (name, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "invalid_model_config" and error["field"] == "model", (name, error)
        assert words in error["message"], (name, error["message"])
        assert elapsed < 30, (name, elapsed)  # a second or two on a quiet host
    assert growth < RSS_GROWTH_BYTES, f"the API grew by {growth >> 20} MiB"
    assert max(health) < HEALTHZ_S, sorted(health)[-5:]
