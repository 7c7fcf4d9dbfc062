"""A calibrated job whose Slurm allocation ends by its time limit mid-calibration: its rank hands the attempt back,
the dispatcher submits the job again, the new allocation resumes at the first layer the record lacks, and the job
publishes once the same bytes an uninterrupted run writes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.executors.slurm_cluster import SlurmCluster, pause_conversion_when
from tests.service.executors.test_slurm_service import _events, _finished, _slurm_ids, _submit, _tail, serving
from tests.service_helpers import wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[3]
LAYERS = 6
#: each layer runs 64 steps of 512 tokens through a 256-wide layer. The layers need not outlast Slurm's time limit:
#: the conversion is stopped right after layer 0 (pause_conversion_when) until slurmd ends the job, and slurmd's
#: SIGTERM follows its SIGCONT at once
BODY = {"recipe": {"backend": "ao", "recipe_name": "tensorwise"}, "measure": False,
        "calibration": {"steps": 64, "batch_size": 1, "seq_len": 512}, "serving_formats": ["compressed-tensors-fp8"]}
#: what only describes the run: the report (timings, the layer it resumed at) and the manifest listing it
RUN_FACTS = {"fp8_report.json", "manifest.json"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    root = tmp_path_factory.mktemp("models")
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "six-layers")
    return root / "six-layers"


def _uninterrupted(request: dict, out: Path, root: Path) -> dict[str, str]:
    """The request converted in one process, one thread (as the service's ranks run): each file's sha256."""
    code = ("import json, sys; from pathlib import Path; from converters.model.sources import ModelSourceOptions; "
            "from converters.pipeline.driver import run_conversion; "
            "from converters.pipeline.request import ConversionRequest; "
            "request = ConversionRequest.from_dict(json.loads(sys.argv[1])); "
            "run_conversion(request, Path(sys.argv[2]), ModelSourceOptions(allowed_roots=(Path(sys.argv[3]),)))")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
    subprocess.run([sys.executable, "-c", code, json.dumps(request), str(out), str(root)], cwd=ROOT, env=env,
                   check=True, timeout=1200)
    return {path.relative_to(out).as_posix(): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in out.rglob("*") if path.is_file()}


def test_a_time_limit_mid_calibration_resumes_in_a_new_allocation_and_publishes_the_same_bytes(
        slurm: SlurmCluster, tmp_path: Path, model: Path) -> None:
    body = {**BODY, "model": str(model), "slurm": {"time_limit": "30"}}  # the job's own limit, over the settings'
    with serving(slurm, tmp_path, model.parent) as client:
        job_id = _submit(client, body)
        [first] = wait_for(lambda: _slurm_ids(client, job_id), timeout=60, what="the submission")
        assert slurm.job_field(first, "TimeLimit") == "00:30:00"
        record = tmp_path / "data" / "slurm" / job_id / "resume"
        # the calibrating process is paused right after layer 0 and the limit lowered then, so that the allocation
        # ends mid-calibration on any CPU; ending a job, slurmd sends SIGCONT before SIGTERM
        pause_conversion_when(first, lambda: (record / "layer-0.safetensors").exists(), context=lambda: _tail(client))
        slurm.end_by_time_limit(first)
        wait_for(lambda: slurm.job_states(first)[0] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"),
                 timeout=180, interval=1, what=f"Slurm's time limit to end job {first}")
        assert slurm.job_states(first) == ["TIMEOUT"], _tail(client)
        finished = sorted(path.name for path in record.glob("layer-*.safetensors"))
        assert f"layer-{LAYERS - 1}.safetensors" not in finished, finished  # it stopped mid-calibration
        done = wait_for(lambda: _finished(client, job_id), timeout=900, interval=1, what="the job to finish")
        assert done["status"] == "succeeded" and done["attempt"] == 1, (done, _tail(client))  # no attempt used up
        events = _events(client, job_id)
        assert [e["data"]["status"] for e in events if e["kind"] == "status"].count("succeeded") == 1
        handed_back = [e["data"].get("reason") for e in events
                       if e["kind"] == "status" and e["data"]["status"] == "queued"]
        assert handed_back == [None, "worker_shutdown"], handed_back
        listing = client.get(f"/v1/jobs/{job_id}/artifacts").json()["data"]
        published = {entry["name"]: hashlib.sha256(client.get(entry["url"]).content).hexdigest() for entry in listing}
        report = json.loads(client.get(next(e["url"] for e in listing if e["name"] == "fp8_report.json")).content)
    forward = report["calibration"]["forward"]
    assert 1 <= forward["resumed_at_layer"] < LAYERS and forward["layers_run"] == \
        list(range(forward["resumed_at_layer"], LAYERS)), forward
    expected = _uninterrupted({key: value for key, value in body.items() if key != "slurm"}, tmp_path / "whole",
                              model.parent)
    assert set(published) == set(expected)
    assert {name for name in published if published[name] != expected[name]} <= RUN_FACTS
    assert not record.exists()  # removed once published
