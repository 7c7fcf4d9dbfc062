"""Bad sources submitted as jobs to a real server and worker (`fp8forge serve --workers 1`, SQLite): a convert job
and a requantize job each fail, their error names the file and the tensor, and nothing is published (no artifact,
no staging directory left behind)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from converters.model.files import INDEX_NAME
from tests.service_helpers import ServeProcess, leftovers, wait_for

pytestmark = pytest.mark.slow

Q_PROJ = "model.layers.1.self_attn.q_proj.weight"


def _shard(directory: Path) -> str:
    return json.loads((directory / INDEX_NAME).read_text())["weight_map"][Q_PROJ]


def _rewrite(path: Path, name: str, value: torch.Tensor | None) -> None:
    tensors = load_file(path)
    if value is None:
        tensors.pop(name)
    else:
        tensors[name] = value
    save_file(tensors, path, metadata={"format": "pt"})


def index_mismatch(directory: Path) -> list[str]:
    _rewrite(directory / _shard(directory), Q_PROJ, None)
    return [INDEX_NAME, Q_PROJ, _shard(directory)]


def shape_contradicts_config(directory: Path) -> list[str]:
    _rewrite(directory / _shard(directory), Q_PROJ, torch.zeros(96, 128, dtype=torch.bfloat16))
    return [_shard(directory), Q_PROJ, "[96, 128]"]


def gptq(directory: Path) -> list[str]:
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (directory / "config.json").write_text(json.dumps(config))
    return ["config.json", "'gptq'"]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[str]]]:
    from transformers import AutoModelForCausalLM

    from converters.model.demo import build_tiny_llama

    root = tmp_path_factory.mktemp("bad-source-models")
    sound = root / "sound"
    AutoModelForCausalLM.from_pretrained(build_tiny_llama(root / "one")).save_pretrained(sound, max_shard_size="100KB")
    expected = {}
    for damage in (index_mismatch, shape_contradicts_config, gptq):
        shutil.copytree(sound, root / damage.__name__)
        expected[damage.__name__] = damage(root / damage.__name__)
    return root, expected


def _finished(client: httpx.Client, job_id: str) -> dict | None:
    job = client.get(f"/v1/jobs/{job_id}").json()
    return job if job["status"] in ("succeeded", "failed", "cancelled") else None


def test_bad_sources_fail_their_jobs_naming_file_and_tensor(tmp_path: Path, sources) -> None:
    root, expected = sources
    env = {"FP8FORGE_ALLOWED_MODEL_ROOTS": str(root), "FP8FORGE_POLL_INTERVAL_S": "0.2",
           "FP8FORGE_CONVERSION_THREADS": "1"}
    kinds = {"convert": {"recipe": {"backend": "te"}, "calibration": {"steps": 1, "seq_len": 8}},
             "requantize": {"requantize": {"to": "fp8-block"}}}
    with ServeProcess(tmp_path / "data", workers=1, env=env) as server, server.client() as client:
        jobs = {}
        for case in expected:
            for kind, fields in kinds.items():
                response = client.post("/v1/jobs", json={"model": str(root / case), **fields})
                assert response.status_code == 202, response.text
                jobs[(case, kind)] = response.json()["id"]
        for (case, kind), job_id in jobs.items():
            job = wait_for(lambda job_id=job_id: _finished(client, job_id), timeout=300, what=f"{case} {kind}")
            assert job["status"] == "failed", (case, kind, job, server.tail())
            message = job["error"]["message"]
            for part in expected[case]:
                assert part in message, (case, kind, part, message)
            listing = client.get(f"/v1/jobs/{job_id}/artifacts")
            assert listing.status_code != 200 or listing.json()["data"] == [], (case, kind, listing.text)
        assert leftovers(server.data_dir / "jobs") == []
