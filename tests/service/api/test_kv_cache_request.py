"""The kv_cache request field: library validation, the HTTP API (real uvicorn on loopback) and the CLI flag."""

from __future__ import annotations

import pytest

from converters.errors import RequestError
from converters.pipeline.request import KV_CACHE_FORMAT_NAMES, ConversionRequest
from service.cli.convert import request_from_args
from service.cli.main import build_parser
from service.cli.wording import in_cli_words

MODEL = "demo/tiny-llama"
BODY = {"model": MODEL, "recipe": {"backend": "ao"}, "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}


@pytest.mark.parametrize(("fields", "says"), [
    ({"kv_cache": "fp8"}, "serving_formats"),
    ({"kv_cache": "fp8", "serving_formats": ["fp8-block"]}, "compressed-tensors-fp8"),
    ({"kv_cache": "fp16", "serving_formats": ["compressed-tensors-fp8"]}, "fp8"),
    ({"kv_cache": True, "serving_formats": ["compressed-tensors-fp8"]}, "fp8"),
])
def test_the_library_refuses_kv_cache_it_cannot_write(fields, says):
    with pytest.raises(RequestError) as info:
        ConversionRequest.from_dict({**BODY, **fields})
    assert info.value.field == "kv_cache" and says in info.value.message


def test_kv_cache_with_a_format_that_writes_it_is_kept():
    for name in KV_CACHE_FORMAT_NAMES:
        request = ConversionRequest.from_dict({**BODY, "kv_cache": "fp8", "serving_formats": [name, "fp8-block"]})
        assert request.kv_cache == "fp8" and request.to_dict()["kv_cache"] == "fp8"
    assert ConversionRequest.from_dict(BODY).kv_cache is None


def test_api_answers_422_naming_kv_cache_without_a_serving_format(client):
    response = client.post("/v1/jobs", json={**BODY, "kv_cache": "fp8"})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == "kv_cache" and "serving_formats" in error["message"]


def test_api_answers_422_for_an_unknown_kv_cache_dtype(client):
    response = client.post("/v1/jobs", json={**BODY, "kv_cache": "int8", "serving_formats": ["compressed-tensors-fp8"]})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["field"] == "kv_cache"


def test_api_queues_a_job_with_kv_cache_and_a_serving_format(client):
    response = client.post("/v1/jobs", json={**BODY, "kv_cache": "fp8", "serving_formats": ["compressed-tensors-fp8"]})
    assert response.status_code in (201, 202), response.text


def test_cli_flag_reaches_the_request():
    args = build_parser().parse_args(["convert", MODEL, "--out", "out", "--serving", "compressed-tensors-fp8",
                                      "--kv-cache", "fp8"])
    request, _ = request_from_args(args)
    assert request.kv_cache == "fp8" and request.serving_formats == ("compressed-tensors-fp8",)
    request, _ = request_from_args(build_parser().parse_args(["convert", MODEL, "--out", "out"]))
    assert request.kv_cache is None


def test_cli_error_names_the_flags():
    args = build_parser().parse_args(["convert", MODEL, "--out", "out", "--kv-cache", "fp8"])
    with pytest.raises(RequestError) as info:
        request_from_args(args)
    message = in_cli_words(info.value.message)
    assert "--kv-cache" in message and "--serving" in message
    with pytest.raises(SystemExit):
        build_parser().parse_args(["convert", MODEL, "--out", "out", "--kv-cache", "int8"])
