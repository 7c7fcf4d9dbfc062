"""Strict input over real HTTP (uvicorn on loopback, SQLite, no worker): no coercion, every error names the
field as the client sent it, every code is a documented one, 400 for a body that is not JSON, 416 for any bad
Range, 405 with the full Allow header."""

from __future__ import annotations

import pytest

from converters.errors import Fp8ForgeError, RequestError
from converters.pipeline.request import ConversionRequest
from service.api.error_responses import error_response
from service.errors import ERROR_CODES, ServiceError
from service.store import JobStore
from tests.service_helpers import live_app, publish_job, queue_only_settings

MODEL = "demo/tiny-llama"
GOOD = {"model": MODEL, "recipe": {"backend": "ao"}, "calibration": {"steps": 2, "batch_size": 1, "seq_len": 16}}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("strict")
    settings = queue_only_settings(root)
    with live_app(settings) as client:
        store = JobStore(settings.store_url)
        job = publish_job(store, settings.jobs_dir, {"blob.bin": bytes(4096)})  # before any other job queues
        yield client, store, job
        store.close()


@pytest.fixture
def client(served):
    return served[0]


def _error(response, status: int, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) <= {"code", "message", "field"} and error["message"]
    assert error["code"] in ERROR_CODES
    if code:
        assert error["code"] == code, error
    return error


def _with(path: str, value, body: dict | None = None) -> dict:
    """``body`` (GOOD) with the dotted ``path`` set to ``value``."""
    result = {key: (dict(v) if isinstance(v, dict) else v) for key, v in (body or GOOD).items()}
    *parents, last = path.split(".")
    node = result
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return result


def _queued(client) -> int:
    return client.get("/v1/jobs", params={"status": "queued"}).json()["count"]


COERCIONS = [  # (dotted path, a value of the wrong JSON type that used to be coerced or is easy to send)
    ("calibration.steps", "8"),
    ("calibration.steps", True),
    ("calibration.steps", 8.5),
    ("calibration.batch_size", "1"),
    ("calibration.seq_len", [16]),
    ("calibration.backward", "yes"),
    ("calibration.backward", 1),
    ("calibration.texts", "one text"),
    ("skip_first_last", "no"),
    ("skip_first_last", 0),
    ("convert_router_gates", "true"),
    ("te_extra_state", "false"),
    ("model", 123),
    ("include", "layers.0"),
    ("serving_formats", "fp8-block"),
    ("recipe.pad_inner_dim", "false"),
    ("recipe.emulate", 1),
    ("recipe.recipe_name", "TENSORWISE"),
    ("recipe.version", "1"),
]


@pytest.mark.parametrize(("path", "value"), COERCIONS, ids=[f"{p}={v!r}" for p, v in COERCIONS])
def test_job_fields_are_not_coerced(client, path: str, value) -> None:
    before = _queued(client)
    error = _error(client.post("/v1/jobs", json=_with(path, value)), 422, "invalid_request")
    assert error["field"] == path
    assert _queued(client) == before


TE_COERCIONS = [
    ("recipe.amax_history_len", "16"),
    ("recipe.margin", True),
    ("recipe.interval", "1"),
    ("recipe.fp8_format", "hybrid"),
    ("recipe.amax_compute_algo", "MAX"),
    ("recipe.override_linear_precision", "(false, false, false)"),
    ("recipe.use_autocast_during_eval", "no"),
    ("recipe.backend", "TE"),
    ("recipe.scaling", "Delayed"),
]


@pytest.mark.parametrize(("path", "value"), TE_COERCIONS, ids=[f"{p}={v!r}" for p, v in TE_COERCIONS])
def test_recipe_fields_take_only_their_canonical_json(client, path: str, value) -> None:
    body = _with(path, value, _with("recipe", {"backend": "te"}))
    error = _error(client.post("/v1/jobs", json=body), 422, "invalid_request")
    assert error["field"] == path


def test_an_integral_json_number_is_an_integer(client) -> None:
    # JSON has one number type; JSON Schema (and so the OpenAPI schema) calls 16.0 an integer
    response = client.post("/v1/jobs", json=_with("calibration.seq_len", 16.0))
    assert response.status_code == 202, response.text
    assert response.json()["request"]["calibration"]["seq_len"] == 16


UNKNOWN = [  # (body, the field the error must name: the full dotted path of what the client sent)
    ({**GOOD, "surprise": 1}, "surprise"),
    (_with("calibration.stepz", 2), "calibration.stepz"),
    (_with("recipe", {"backend": "ao", "recipe_nam": "rowwise"}), "recipe.recipe_nam"),
    (_with("recipe", {"backend": "te", "scaling": "current", "margin": 1}), "recipe.margin"),
    (_with("recipe", {"backend": "te", "te": 1}), "recipe.te"),
    (_with("recipe", {"backend": "te", "[te delayed]": 1}), "recipe.[te delayed]"),
    (_with("recipe", {}), "recipe.backend"),
    (_with("recipe", {"backend": "nope"}), "recipe.backend"),
    (_with("recipe", {"backend": "msamp"}), "recipe.backend"),
    (_with("recipe", {"backend": "te", "scaling": "sideways"}), "recipe.scaling"),
    (_with("recipe", {"backend": "te", "scaling": ["current"]}), "recipe.scaling"),
    (_with("recipe", "tensorwise"), "recipe"),
    (_with("recipe", ["te"]), "recipe"),
    (_with("recipe", {"backend": "te", "override_linear_precision": [True, "no", False]}),
     "recipe.override_linear_precision[1]"),
    (_with("calibration.texts", ["fine", 2]), "calibration.texts[1]"),
    (_with("include", ["layers.0", "a b"]), "include[1]"),
    (_with("serving_formats", ["fp8-block", "gguf"]), "serving_formats[1]"),
    ({"recipe": {"backend": "ao"}}, "model"),
    ([GOOD], "body"),
]


@pytest.mark.parametrize(("body", "field"), UNKNOWN, ids=[f for _, f in UNKNOWN])
def test_errors_name_the_dotted_path_the_client_sent(client, body, field: str) -> None:
    assert _error(client.post("/v1/jobs", json=body), 422, "invalid_request")["field"] == field


@pytest.mark.parametrize(("body", "field"), [
    ({"model": MODEL, "backend": "TE"}, "backend"),
    ({"model": MODEL, "backend": "fp4"}, "backend"),
    ({"model": MODEL, "skip_first_last": "no"}, "skip_first_last"),
    ({"model": MODEL, "include": ["ok", 3]}, "include[1]"),
    ({"model": MODEL, "backnd": "ao"}, "backnd"),
])
def test_analyze_is_strict_too(client, body: dict, field: str) -> None:
    assert _error(client.post("/v1/analyze", json=body), 422, "invalid_request")["field"] == field


NOT_JSON = [
    (b"{not json", "application/json"),
    (b'{"model": "demo/tiny-llama",}', "application/json"),
    (b'{"model": "demo/tiny-llama"', "application/json"),
    (b"\xff\xfe\x00garbage", "application/json"),
    (b'{"model": "demo/tiny-llama"}', "text/plain"),
    (b"model=demo/tiny-llama", "application/x-www-form-urlencoded"),
]


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/analyze"])
@pytest.mark.parametrize(("content", "content_type"), NOT_JSON)
def test_a_body_that_is_not_json_is_400_without_a_field(client, path: str, content: bytes, content_type: str) -> None:
    before = _queued(client)
    error = _error(client.post(path, content=content, headers={"content-type": content_type}), 400, "invalid_json")
    assert error.get("field") in (None, "body")  # never a character offset
    assert _queued(client) == before


def test_bad_values_get_documented_codes_never_the_generic_one(client) -> None:
    assert _error(client.post("/v1/jobs", json=_with("serving_formats", ["gguf"])), 422)["code"] == "invalid_request"
    assert _error(client.post("/v1/analyze", json={"model": MODEL, "backend": "xx"}), 422)["code"] == "invalid_request"


@pytest.mark.parametrize("value", [5 * 2**30, None, "5GB"])
def test_a_removed_field_is_refused_by_name_with_what_to_do(client, value) -> None:
    before = _queued(client)
    error = _error(client.post("/v1/jobs", json=_with("max_shard_bytes", value)), 422, "invalid_request")
    assert error["field"] == "max_shard_bytes"
    assert "max_shard_bytes was removed" in error["message"] and "drop it" in error["message"]
    assert _queued(client) == before
    with pytest.raises(RequestError, match="max_shard_bytes was removed") as info:  # the library and the CLI too
        ConversionRequest.from_dict({"model": MODEL, "max_shard_bytes": value})
    assert info.value.field == "max_shard_bytes"
    assert "max_shard_bytes" not in client.get("/openapi.json").json()["components"]["schemas"]["JobCreate"][
        "properties"]


def test_every_error_class_has_a_documented_code() -> None:
    import converters.analysis.patterns  # noqa: F401 - defines PatternError

    def descendants(cls):
        for sub in cls.__subclasses__():
            yield sub
            yield from descendants(sub)

    for cls in (ServiceError, *descendants(ServiceError), *descendants(Fp8ForgeError)):
        assert cls.code in ERROR_CODES, f"{cls.__name__}.code {cls.code!r} is not in service.errors.ERROR_CODES"
    # the library's base class has no code of its own on the wire
    assert error_response(Fp8ForgeError("bad")).body == error_response(RequestError("bad")).body


def test_the_schema_lists_exactly_the_error_codes(client) -> None:
    spec = client.get("/openapi.json").json()
    assert spec["components"]["schemas"]["ErrorCode"]["enum"] == list(ERROR_CODES)
    assert spec["components"]["schemas"]["ErrorDetail"]["properties"]["code"] == {
        "$ref": "#/components/schemas/ErrorCode"}


def test_every_route_with_a_body_documents_400_and_every_error_uses_the_error_body(client) -> None:
    spec = client.get("/openapi.json").json()
    for path, operations in spec["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            if "requestBody" in operation:
                assert "400" in responses, f"{method.upper()} {path} does not document 400"
            for status, response in responses.items():
                if int(status) >= 400 and "content" in response:
                    schema = response["content"]["application/json"]["schema"]
                    assert schema in ({"$ref": "#/components/schemas/ErrorBody"},
                                      {"$ref": "#/components/schemas/ReadyPublic"}), (method, path, status)


def test_the_library_is_as_strict_as_the_api() -> None:
    cases = [({"model": MODEL, "calibration": {"steps": "8"}}, "calibration.steps"),
             ({"model": MODEL, "calibration": {"backward": "yes"}}, "calibration.backward"),
             ({"model": MODEL, "skip_first_last": "no"}, "skip_first_last"),
             ({"model": MODEL, "recipe": {"backend": "ao", "recipe_nam": "x"}}, "recipe.recipe_nam"),
             ({"model": MODEL, "recipe": {"backend": "te", "margin": True}}, "recipe.margin"),
             ({"model": MODEL, "max_shard_bytes": 5 * 2**30}, "max_shard_bytes")]
    for body, field in cases:
        with pytest.raises(Fp8ForgeError) as info:
            ConversionRequest.from_dict(body)
        assert info.value.field == field and info.value.code in ERROR_CODES


@pytest.mark.parametrize("method,path,allow", [
    ("PUT", "/v1/jobs", "GET, POST"),
    ("PATCH", "/v1/jobs/abc", "GET, DELETE"),
    ("GET", "/v1/jobs/abc/cancel", "POST"),
    ("DELETE", "/v1/analyze", "POST"),
    ("POST", "/healthz", "GET"),
    ("PUT", "/v1/jobs/abc/artifacts/a/b.json", "GET, HEAD"),
])
def test_405_lists_every_method_of_the_path(client, method: str, path: str, allow: str) -> None:
    response = client.request(method, path)
    assert response.status_code == 405 and response.headers["allow"] == allow
    _error(response, 405, "method_not_allowed")


BAD_RANGES = ["bytes=", "bytes=-", "bytes=abc", "bytes=5-1", "items=0-1", "bytes=0-1,5-6", "bytes=0-1,",
              "bytes=99999999999999999999-", "bytes=--1", "bytes=1-2-3", "bytes=-0", "bytes=4096-", "",
              "bytes=0x10-", "bytes=1e3-", "bytes=+1-2", "0-1",
              "bytes=\u0661-2".encode().decode("latin-1"),  # an Arabic-Indic digit one, as UTF-8 bytes
              "bytes=0-" + "1" * 300]


@pytest.mark.parametrize("range_", BAD_RANGES)
@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_every_bad_range_is_416(served, method: str, range_: str) -> None:
    client, _, job = served
    headers = {"Range": range_.encode("latin-1")}
    response = client.request(method, f"/v1/jobs/{job.id}/artifacts/blob.bin", headers=headers)
    assert response.status_code == 416, response.text
    assert response.headers["content-range"] == "bytes */4096"
    if method == "GET":
        _error(response, 416, "range_not_satisfiable")
