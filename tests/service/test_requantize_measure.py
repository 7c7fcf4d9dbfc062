"""`measure` of a requantize job, as the CLI (`--no-measure`) and the API (`requantize.measure`) take it: off, the
same bytes and a report without the weight SQNR figures; a value that is not a boolean is refused naming the field."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from service.cli.main import main
from service.config import Settings
from service.store import JobStore
from service.workers.task_kinds import plan_payload
from tests.service_helpers import live_app


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from converters.model.demo import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


def _requantize(model_dir: Path, out: Path, *extra: str) -> dict:
    assert main(["requantize", str(model_dir), "--out", str(out), "--to", "compressed-tensors-fp8-dynamic",
                 "--allow-root", str(model_dir.parent), "--no-progress", *extra]) == 0
    return json.loads((out / "requantize_report.json").read_text())


def _digests(directory: Path) -> dict[str, str]:
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in directory.glob("*.safetensors")}


def test_no_measure_writes_the_same_bytes_and_leaves_the_figures_out(model_dir: Path, tmp_path: Path) -> None:
    measured = _requantize(model_dir, tmp_path / "measured")
    unmeasured = _requantize(model_dir, tmp_path / "unmeasured", "--no-measure")
    assert _digests(tmp_path / "measured") == _digests(tmp_path / "unmeasured")
    assert measured["options"]["measure"] is True and unmeasured["options"]["measure"] is False
    assert measured["quantized"] == unmeasured["quantized"] and measured["quantized"]
    assert sorted(measured["layer_stats"]) == sorted(name.removesuffix(".weight") for name in measured["quantized"])
    assert not unmeasured.get("layer_stats")


@pytest.fixture
def api(tmp_path: Path):
    settings = Settings(data_dir=tmp_path / "data", auth_disabled=True, workers=0)
    with live_app(settings) as client:
        yield client, settings


def test_the_api_takes_measure_and_the_plan_task_gets_it(api) -> None:
    client, settings = api
    ids = {}
    for measure in (False, True, None):
        body = {"to": "fp8-block"} | ({} if measure is None else {"measure": measure})
        response = client.post("/v1/jobs", json={"model": "demo/tiny-llama", "requantize": body})
        assert response.status_code == 202, response.text
        ids[measure] = response.json()["id"]
    store = JobStore(settings.store_url)
    try:
        payloads = {measure: plan_payload(store.get_job(job_id).request) for measure, job_id in ids.items()}
    finally:
        store.close()
    assert [payloads[False]["measure"], payloads[True]["measure"], payloads[None]["measure"]] == [False, True, True]


def test_a_measure_that_is_not_a_boolean_is_refused_naming_it(api) -> None:
    client, _ = api
    response = client.post("/v1/jobs", json={"model": "demo/tiny-llama", "requantize": {"to": "fp8-block",
                                                                                      "measure": "no"}})
    assert response.status_code == 422, response.text
    assert "measure" in response.text
