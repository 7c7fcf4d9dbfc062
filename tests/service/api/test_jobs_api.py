"""The HTTP API on a real uvicorn (loopback) with a real SQLite store, no workers: jobs and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from service.config import Settings
from service.jobs import JobStatus
from service.store import JobStore
from tests.service_helpers import live_app

GOOD = {"model": "demo/tiny-llama", "recipe": {"backend": "ao", "recipe_name": "tensorwise"},
        "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    (tmp_path / "models").mkdir()
    return Settings(data_dir=tmp_path / "data", auth_disabled=True, allowed_model_roots=(tmp_path / "models",),
                    max_body_bytes=4096, workers=0)


@pytest.fixture
def client(settings: Settings):
    with live_app(settings) as client:
        yield client


@pytest.fixture
def store(settings: Settings, client):
    store = JobStore(settings.store_url)
    yield store
    store.close()


def _files(root: Path) -> set[str]:
    # the SQLite files change with every request; everything else must stay as it was
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if "fp8forge.db" not in p.name}


def _error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) <= {"code", "message", "field"} and error["message"]
    if code:
        assert error["code"] == code
    return error


def test_health_ready_and_metrics(client, store) -> None:
    assert client.get("/healthz").json() == {"status": "ok"}
    not_ready = client.get("/readyz")
    assert not_ready.status_code == 503 and not_ready.json() == {"ready": False, "store": True, "workers": 0}
    store.workers.heartbeat("w-test")
    assert client.get("/readyz").json() == {"ready": True, "store": True, "workers": 1}
    assert client.post("/v1/jobs", json=GOOD).status_code == 202
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    samples = _metric_samples(metrics.text)
    assert samples[("fp8forge_jobs", (("status", "queued"),))] == 1
    assert samples[("fp8forge_workers", ())] == 1
    assert samples[("fp8forge_stage_duration_seconds_count", (("stage", "calibrate"),))] == 0


def test_metrics_count_outcomes_retries_stage_seconds_and_bytes(client, store) -> None:
    ids = [client.post("/v1/jobs", json={**GOOD, "calibration": {"steps": i + 1}}).json()["id"] for i in range(3)]
    for _ in ids:
        assert store.claim_next("w-test") is not None
    store.set_status(ids[0], JobStatus.SUCCEEDED, artifacts=[{"name": "a.safetensors", "bytes": 1000, "sha256": "0"},
                                                            {"name": "fp8_report.json", "bytes": 24, "sha256": "1"}])
    store.set_status(ids[1], JobStatus.FAILED, error_code="out_of_memory", error_message="killed")
    store.timings.record(ids[0], [("calibrate", 3.0), ("export", 100.0)])
    with store.engine.begin() as conn:
        conn.execute(store.tables.jobs.update().where(store.tables.jobs.c.id == ids[0]).values(attempt=3))
    samples = _metric_samples(client.get("/metrics").text)
    assert samples[("fp8forge_jobs_finished_total", (("error_code", ""), ("status", "succeeded")))] == 1
    assert samples[("fp8forge_jobs_finished_total", (("error_code", "out_of_memory"), ("status", "failed")))] == 1
    assert samples[("fp8forge_retries_total", (("of", "job"),))] == 2
    assert samples[("fp8forge_artifact_bytes_total", ())] == 1024
    calibrate = (("stage", "calibrate"),)
    assert samples[("fp8forge_stage_duration_seconds_bucket", (("le", "1.0"), *calibrate))] == 0
    assert samples[("fp8forge_stage_duration_seconds_bucket", (("le", "5.0"), *calibrate))] == 1
    assert samples[("fp8forge_stage_duration_seconds_bucket", (("le", "60.0"), ("stage", "export")))] == 0
    assert samples[("fp8forge_stage_duration_seconds_sum", (("stage", "export"),))] == 100.0


def _metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, read by prometheus_client's own parser (so the text must be valid)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_submit_get_list_and_idempotency(client) -> None:
    created = client.post("/v1/jobs", json=GOOD, headers={"Idempotency-Key": "abc"})
    assert created.status_code == 202
    job = created.json()
    assert job["status"] == "queued" and job["attempt"] == 0 and job["progress"]["fraction"] == 0
    assert job["links"] == {"self": f"/v1/jobs/{job['id']}", "events": f"/v1/jobs/{job['id']}/events",
                            "artifacts": f"/v1/jobs/{job['id']}/artifacts", "report": None,
                            "tasks": f"/v1/jobs/{job['id']}/tasks", "archive": None}
    assert client.get(job["links"]["self"]).json()["id"] == job["id"]
    again = client.post("/v1/jobs", json=GOOD, headers={"Idempotency-Key": "abc"})
    assert again.status_code == 202 and again.json()["id"] == job["id"]
    other = {**GOOD, "calibration": {"steps": 3}}
    _error(client.post("/v1/jobs", json=other, headers={"Idempotency-Key": "abc"}), 409, "idempotency_conflict")
    second = client.post("/v1/jobs", json=other).json()
    listed = client.get("/v1/jobs").json()
    assert [j["id"] for j in listed["data"]] == [second["id"], job["id"]] and listed["count"] == 2


def test_list_pages_with_cursor_and_filters_by_status(client) -> None:
    ids = [client.post("/v1/jobs", json={**GOOD, "calibration": {"steps": i + 1}}).json()["id"] for i in range(5)]
    client.post(f"/v1/jobs/{ids[0]}/cancel")
    seen, cursor = [], None
    while True:
        page = client.get("/v1/jobs", params={"limit": 2, **({"cursor": cursor} if cursor else {})}).json()
        seen += [j["id"] for j in page["data"]]
        if not (cursor := page["next_cursor"]):
            break
    assert seen == ids[::-1]
    cancelled = client.get("/v1/jobs", params={"status": "cancelled"}).json()["data"]
    assert [j["id"] for j in cancelled] == [ids[0]]
    assert _error(client.get("/v1/jobs", params={"status": "bogus"}), 422)["field"] == "status"
    for bad in ("zz", "²", "9" * 30, "-5"):  # never a 500, whatever the database makes of a huge number
        assert _error(client.get("/v1/jobs", params={"cursor": bad}), 422)["field"] == "cursor"


def test_cancel_queued_then_again_conflicts_then_delete(client) -> None:
    job = client.post("/v1/jobs", json=GOOD).json()
    _error(client.delete(f"/v1/jobs/{job['id']}"), 409, "invalid_transition")
    cancelled = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert cancelled.status_code == 202 and cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["finished_at"] is not None
    _error(client.post(f"/v1/jobs/{job['id']}/cancel"), 409, "invalid_transition")
    assert client.delete(f"/v1/jobs/{job['id']}").status_code == 204
    _error(client.get(f"/v1/jobs/{job['id']}"), 404, "job_not_found")


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/jobs/nope"), ("POST", "/v1/jobs/nope/cancel"), ("DELETE", "/v1/jobs/nope"),
    ("GET", "/v1/jobs/nope/events"), ("GET", "/v1/jobs/nope/artifacts"), ("GET", "/v1/jobs/nope/artifacts/x"),
    ("HEAD", "/v1/jobs/nope/artifacts/x"),
])
def test_unknown_job_is_404(client, method: str, path: str) -> None:
    response = client.request(method, path)
    assert response.status_code == 404
    if method != "HEAD":
        _error(response, 404, "job_not_found")


def test_unknown_route_uses_the_error_shape(client) -> None:
    _error(client.get("/v2/nothing"), 404, "not_found")


BAD_BODIES = [
    ({**GOOD, "recipe": {"backend": "te", "amax_history_len": -1}}, "recipe.amax_history_len"),
    ({**GOOD, "recipe": {"backend": "nope"}}, "recipe.backend"),
    ({**GOOD, "recipe": "tensorwise"}, "recipe"),
    ({**GOOD, "calibration": {"steps": "many"}}, "calibration.steps"),
    ({**GOOD, "calibration": {"steps": 0}}, "calibration.steps"),
    ({**GOOD, "calibration": {"texts": [1, 2]}}, "calibration.texts[0]"),
    ({**GOOD, "model": "../../etc"}, "model"),
    ({**GOOD, "model": "/etc/ssh"}, "model"),
    ({**GOOD, "model": "./models/../../secret"}, "model"),
    ({**GOOD, "model": "https://example.com/model.bin"}, "model"),
    ({**GOOD, "model": "file:///etc/passwd"}, "model"),
    ({**GOOD, "model": ""}, "model"),
    ({**GOOD, "surprise": 1}, "surprise"),
    ({"recipe": {"backend": "ao"}}, "model"),
    ({**GOOD, "serving_formats": ["compressed-tensors-fp8", "gguf"]}, "serving_formats[1]"),
]


@pytest.mark.parametrize("body,field", BAD_BODIES, ids=[f for _, f in BAD_BODIES])
def test_bad_bodies_are_422_naming_the_field_and_leave_nothing(client, settings, body: dict, field: str) -> None:
    before = _files(settings.data_dir)
    error = _error(client.post("/v1/jobs", json=body), 422)
    assert error["field"] == field, error
    assert client.get("/v1/jobs").json()["count"] == 0
    assert _files(settings.data_dir) == before


def test_malformed_json_is_400(client) -> None:
    response = client.post("/v1/jobs", content=b"{not json", headers={"content-type": "application/json"})
    assert "field" not in _error(response, 400, "invalid_json")


def test_oversized_body_is_413_and_leaves_nothing(client, settings) -> None:
    before = _files(settings.data_dir)
    big = {**GOOD, "calibration": {"texts": ["x" * 5000]}}
    _error(client.post("/v1/jobs", json=big), 413, "body_too_large")

    def chunks():  # no Content-Length: the limit must hold for streamed bodies too
        yield b'{"model": "demo/tiny-llama", "calibration": {"texts": ["'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"]}}'

    _error(client.post("/v1/jobs", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert client.get("/v1/jobs").json()["count"] == 0
    assert _files(settings.data_dir) == before


def test_job_survives_an_api_restart(settings: Settings) -> None:
    with live_app(settings) as client:
        queued = client.post("/v1/jobs", json=GOOD).json()
        cancelled = client.post("/v1/jobs", json={**GOOD, "calibration": {"steps": 5}}).json()
        client.post(f"/v1/jobs/{cancelled['id']}/cancel")
    with live_app(settings) as client:
        statuses = {j["id"]: j["status"] for j in client.get("/v1/jobs").json()["data"]}
    assert statuses == {queued["id"]: JobStatus.QUEUED.value, cancelled["id"]: JobStatus.CANCELLED.value}


def test_analyze_reports_eligibility_without_queueing(client, settings) -> None:
    from tests.service_helpers import build_tiny_llama

    model = build_tiny_llama(settings.allowed_model_roots[0] / "tiny-llama")
    report = client.post("/v1/analyze", json={"model": str(model), "backend": "ao"})
    assert report.status_code == 200, report.text
    assert "down_proj" in report.text
    assert report.json()["options"]["convert_router_gates"] is False
    gates = client.post("/v1/analyze", json={"model": str(model), "backend": "ao", "convert_router_gates": True})
    assert gates.status_code == 200 and gates.json()["options"]["convert_router_gates"] is True
    assert _error(client.post("/v1/analyze", json={"model": "../x"}), 422)["field"] == "model"
    assert client.get("/v1/jobs").json()["count"] == 0
