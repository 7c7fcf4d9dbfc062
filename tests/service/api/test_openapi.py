"""openapi/openapi.json is what the app serves, and operation ids stay stable."""

from __future__ import annotations

import json
from pathlib import Path

from service.config import Settings
from service.main import create_app

SPEC = Path(__file__).parents[3] / "openapi" / "openapi.json"

OPERATIONS = {
    ("post", "/v1/jobs"): "createJob",
    ("get", "/v1/jobs"): "listJobs",
    ("get", "/v1/jobs/{job_id}"): "getJob",
    ("delete", "/v1/jobs/{job_id}"): "deleteJob",
    ("post", "/v1/jobs/{job_id}/cancel"): "cancelJob",
    ("get", "/v1/jobs/{job_id}/events"): "streamJobEvents",
    ("get", "/v1/jobs/{job_id}/artifacts"): "listArtifacts",
    ("get", "/v1/jobs/{job_id}/artifacts/{name}"): "downloadArtifact",
    ("head", "/v1/jobs/{job_id}/artifacts/{name}"): "headArtifact",
    ("get", "/v1/jobs/{job_id}/archive"): "downloadJobArchive",
    ("get", "/v1/jobs/{job_id}/tasks"): "listJobTasks",
    ("post", "/v1/analyze"): "analyzeModel",
    ("get", "/healthz"): "health",
    ("get", "/readyz"): "ready",
    ("get", "/metrics"): "metrics",
}


def test_committed_spec_matches_the_app(tmp_path: Path) -> None:
    served = json.loads(json.dumps(create_app(Settings(data_dir=tmp_path, auth_disabled=True)).openapi()))
    committed = json.loads(SPEC.read_text())
    assert served == committed, "openapi/openapi.json is stale; run: python openapi/generate.py"


def test_operation_ids_are_stable() -> None:
    spec = json.loads(SPEC.read_text())
    found = {(method, path): op["operationId"] for path, ops in spec["paths"].items() for method, op in ops.items()}
    assert found == OPERATIONS


def test_errors_are_documented_with_the_one_error_body() -> None:
    spec = json.loads(SPEC.read_text())
    create = spec["paths"]["/v1/jobs"]["post"]["responses"]
    for status in ("409", "413", "422"):
        assert create[status]["content"]["application/json"]["schema"]["$ref"] == "#/components/schemas/ErrorBody"
