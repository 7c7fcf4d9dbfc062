"""The measure request field: the HTTP API (real uvicorn on loopback) and the CLI's --no-measure."""

from __future__ import annotations

import pytest

from converters.pipeline.request import ConversionRequest
from service.cli.convert import request_from_args
from service.cli.main import build_parser

MODEL = "demo/tiny-llama"
BODY = {"model": MODEL, "recipe": {"backend": "ao"}, "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}


def test_api_queues_a_job_with_measure_off_and_keeps_it(client):
    response = client.post("/v1/jobs", json={**BODY, "measure": False})
    assert response.status_code in (201, 202), response.text
    assert ConversionRequest.from_dict({**BODY, "measure": False}).to_dict()["measure"] is False


@pytest.mark.parametrize("fields", [{"measure": False, "min_sqnr_db": 20}, {"measure": "no"}])
def test_api_answers_422_naming_measure(client, fields):
    response = client.post("/v1/jobs", json={**BODY, **fields})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "measure"


def test_cli_no_measure_reaches_the_request():
    request, _ = request_from_args(build_parser().parse_args(["convert", MODEL, "--out", "out", "--no-measure"]))
    assert request.measure is False
    request, _ = request_from_args(build_parser().parse_args(["convert", MODEL, "--out", "out"]))
    assert request.measure is True
