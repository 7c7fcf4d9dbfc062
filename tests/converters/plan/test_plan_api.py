"""The plan request field through the HTTP API (real uvicorn on loopback): queued as asked, refused naming its field."""

from __future__ import annotations

import pytest

from converters.pipeline.request import ConversionRequest

BODY = {"model": "demo/tiny-llama", "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}


def test_api_queues_a_job_with_a_plan_and_keeps_it(client):
    response = client.post("/v1/jobs", json={**BODY, "plan": {"target_kl": 0.02, "gpu": "b200"}})
    assert response.status_code in (201, 202), response.text
    job = client.get(f"/v1/jobs/{response.json()['id']}").json()
    assert job["request"]["plan"] == {"target_kl": 0.02, "gpu": "b200"}  # as sent; the worker reads it so
    assert ConversionRequest.from_dict(job["request"]).plan == {"target_kl": 0.02, "objective": "memory", "gpu": "b200"}


@pytest.mark.parametrize(("plan", "field"), [
    ({"target_kl": 0.02, "min_sqnr_db": 20}, "plan"),
    ({"objective": "memory"}, "plan"),
    ({"target_kl": 0.02, "gpu": "tpu-v5"}, "plan.gpu"),
    ({"target_kl": -0.5}, "plan.target_kl"),
])
def test_api_answers_422_naming_the_plan_field(client, plan, field):
    response = client.post("/v1/jobs", json={**BODY, "plan": plan})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == field
