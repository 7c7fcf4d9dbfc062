"""Every number and list a client sends is bounded, over real HTTP (uvicorn on loopback, SQLite, no worker):
the value at the bound is queued, one past it is refused naming the field, the OpenAPI schema states the
bound, and the conversion library (which the CLI uses too) enforces the same one."""

from __future__ import annotations

import pytest

from converters import recipes
from converters.analysis.patterns import MAX_PATTERN_CHARS, MAX_PATTERNS, matches
from converters.errors import Fp8ForgeError
from converters.pipeline import request as requests
from converters.pipeline.request import (
    LIMITS,
    MAX_CALIBRATION_TOKENS,
    MAX_TEXT_CHARS,
    MAX_TEXTS_CHARS,
    MAX_TOKENS_PER_STEP,
    SERVING_FORMAT_NAMES,
    CalibrationSettings,
    ConversionRequest,
)
from service.api.events import MAX_EVENT_ID, job_event_stream
from service.config import Settings
from service.errors import ERROR_CODES
from service.jobs import JobStatus
from service.store import JobStore
from tests.service_helpers import live_app

MODEL = "demo/tiny-llama"
SMALL = {"steps": 2, "batch_size": 1, "seq_len": 16}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("bounds")
    (root / "models").mkdir()
    # a body large enough for the longest texts: the body limit is not what these tests are about
    settings = Settings(data_dir=root / "data", allowed_model_roots=(root / "models",), workers=0,
                        auth_disabled=True, hf_offline=True, max_body_bytes=16 * 1024 * 1024,
                        max_queued_jobs_per_key=100_000)
    with live_app(settings) as client:
        yield client, settings


@pytest.fixture
def client(served):
    return served[0]


def _job(recipe: dict | None = None, calibration: dict | None = None, **fields) -> dict:
    return {"model": MODEL, "recipe": recipe or {"backend": "ao"}, "calibration": calibration or SMALL, **fields}


def _refused(client, body: dict, field: str, code: str | None = None, path: str = "/v1/jobs") -> dict:
    before = client.get("/v1/jobs", params={"status": "queued"}).json()["count"]
    response = client.post(path, json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["field"] == field and error["code"] in ERROR_CODES, error
    if code:
        assert error["code"] == code, error
    assert client.get("/v1/jobs", params={"status": "queued"}).json()["count"] == before
    return error


def _queued(client, body: dict) -> None:
    response = client.post("/v1/jobs", json=body)
    assert response.status_code == 202, response.text


TE = {"backend": "te"}
BOUNDS = [  # (name, body at the bound, body past it, the field named)
    ("amax_history_len", _job({**TE, "amax_history_len": recipes.MAX_AMAX_HISTORY_LEN}),
     _job({**TE, "amax_history_len": recipes.MAX_AMAX_HISTORY_LEN + 1}), "recipe.amax_history_len"),
    ("amax_history_len 2**40", None, _job({**TE, "amax_history_len": 2**40}), "recipe.amax_history_len"),
    ("margin", _job({**TE, "margin": recipes.MAX_MARGIN}), _job({**TE, "margin": recipes.MAX_MARGIN + 1}),
     "recipe.margin"),
    ("interval", _job({**TE, "interval": recipes.MAX_INTERVAL}), _job({**TE, "interval": recipes.MAX_INTERVAL + 1}),
     "recipe.interval"),
    ("steps", _job(calibration={"steps": LIMITS["steps"][1], "batch_size": 1, "seq_len": 16}),
     _job(calibration={"steps": LIMITS["steps"][1] + 1, "batch_size": 1, "seq_len": 16}), "calibration.steps"),
    ("batch_size", _job(calibration={"steps": 1, "batch_size": LIMITS["batch_size"][1], "seq_len": 16}),
     _job(calibration={"steps": 1, "batch_size": LIMITS["batch_size"][1] + 1, "seq_len": 16}),
     "calibration.batch_size"),
    ("seq_len", _job(calibration={"steps": 1, "batch_size": 1, "seq_len": LIMITS["seq_len"][1]}),
     _job(calibration={"steps": 1, "batch_size": 1, "seq_len": LIMITS["seq_len"][1] + 1}), "calibration.seq_len"),
    ("include count", _job(include=["q_proj"] * MAX_PATTERNS), _job(include=["q_proj"] * (MAX_PATTERNS + 1)),
     "include"),
    ("exclude count", _job(exclude=["q_proj"] * MAX_PATTERNS), _job(exclude=["q_proj"] * (MAX_PATTERNS + 1)),
     "exclude"),
    ("pattern length", _job(include=["a" * MAX_PATTERN_CHARS]), _job(include=["ok", "a" * (MAX_PATTERN_CHARS + 1)]),
     "include[1]"),
    ("pattern newline", None, _job(exclude=["layers.0\n"]), "exclude[0]"),
    ("texts count", _job(calibration={**SMALL, "texts": ["t"] * LIMITS["texts"][1]}),
     _job(calibration={**SMALL, "texts": ["t"] * (LIMITS["texts"][1] + 1)}), "calibration.texts"),
    ("text length", _job(calibration={**SMALL, "texts": ["t" * MAX_TEXT_CHARS]}),
     _job(calibration={**SMALL, "texts": ["ok", "t" * (MAX_TEXT_CHARS + 1)]}), "calibration.texts[1]"),
    ("no texts", None, _job(calibration={**SMALL, "texts": []}), "calibration.texts"),
    ("blank text", None, _job(calibration={**SMALL, "texts": ["fine", " \n\t"]}), "calibration.texts[1]"),
    ("unicode-blank text", _job(calibration={**SMALL, "texts": ["\u00a0x\u3000"]}),
     _job(calibration={**SMALL, "texts": ["fine", "\u00a0\u2003\u3000\x1f"]}), "calibration.texts[1]"),
    ("serving_formats", _job(serving_formats=list(SERVING_FORMAT_NAMES)),
     _job(serving_formats=[*SERVING_FORMAT_NAMES, SERVING_FORMAT_NAMES[0]]), "serving_formats"),
]


@pytest.mark.parametrize(("at", "past", "field"), [b[1:] for b in BOUNDS], ids=[b[0] for b in BOUNDS])
def test_each_bound_is_enforced_over_http(client, at, past, field: str) -> None:
    if at is not None:
        _queued(client, at)
    _refused(client, past, field, "invalid_request")


CROSS_FIELD = [  # rules between fields: the library checks them (the schema describes them in words)
    ("tokens per step", {"steps": 1, "batch_size": 4, "seq_len": MAX_TOKENS_PER_STEP // 4},
     {"steps": 1, "batch_size": 2, "seq_len": MAX_TOKENS_PER_STEP // 2 + 1}, "calibration"),
    ("tokens per run", {"steps": MAX_CALIBRATION_TOKENS // MAX_TOKENS_PER_STEP, "batch_size": 1,
                        "seq_len": MAX_TOKENS_PER_STEP},
     {"steps": MAX_CALIBRATION_TOKENS // MAX_TOKENS_PER_STEP + 1, "batch_size": 1, "seq_len": MAX_TOKENS_PER_STEP},
     "calibration"),
    ("texts in all", {**SMALL, "texts": ["t" * MAX_TEXT_CHARS] * (MAX_TEXTS_CHARS // MAX_TEXT_CHARS)},
     {**SMALL, "texts": ["t" * MAX_TEXT_CHARS] * (MAX_TEXTS_CHARS // MAX_TEXT_CHARS) + ["t"]}, "calibration.texts"),
]


@pytest.mark.parametrize(("at", "past", "field"), [c[1:] for c in CROSS_FIELD], ids=[c[0] for c in CROSS_FIELD])
def test_cross_field_bounds_are_enforced_over_http(client, at: dict, past: dict, field: str) -> None:
    _queued(client, _job(calibration=at))
    _refused(client, _job(calibration=past), field, "invalid_calibration")


def test_the_old_limits_no_longer_fit(client) -> None:
    # 256 x 32768 tokens a step was accepted before: about 10 GB of logits on the demo model alone
    _refused(client, _job(calibration={"steps": 1, "batch_size": 256, "seq_len": 32768}), "calibration.seq_len")
    _refused(client, _job(calibration={"steps": 1, "batch_size": 256, "seq_len": 64}), "calibration")


def test_analyze_bounds_its_patterns(client) -> None:
    body = {"model": MODEL, "include": ["q_proj"] * (MAX_PATTERNS + 1)}
    _refused(client, body, "include", "invalid_request", path="/v1/analyze")
    _refused(client, {"model": MODEL, "exclude": ["x" * (MAX_PATTERN_CHARS + 1)]}, "exclude[0]", path="/v1/analyze")


SCHEMA_BOUNDS = [  # (component, property, keyword, value): what the OpenAPI schema tells a client
    ("TEDelayedRecipeCreate", "amax_history_len", "maximum", recipes.MAX_AMAX_HISTORY_LEN),
    ("TEDelayedRecipeCreate", "margin", "maximum", recipes.MAX_MARGIN),
    ("TEDelayedRecipeCreate", "interval", "maximum", recipes.MAX_INTERVAL),
    ("TEDelayedRecipeCreate", "override_linear_precision", "maxItems", 3),
    ("CalibrationCreate", "steps", "maximum", LIMITS["steps"][1]),
    ("CalibrationCreate", "batch_size", "maximum", LIMITS["batch_size"][1]),
    ("CalibrationCreate", "seq_len", "maximum", LIMITS["seq_len"][1]),
    ("CalibrationCreate", "texts", "maxItems", LIMITS["texts"][1]),
    ("CalibrationCreate", "texts", "minItems", 1),
    ("CalibrationCreate", "texts", "items.maxLength", MAX_TEXT_CHARS),
    ("CalibrationCreate", "texts", "items.pattern", requests.NOT_BLANK),
    ("JobCreate", "include", "maxItems", MAX_PATTERNS),
    ("JobCreate", "exclude", "items.maxLength", MAX_PATTERN_CHARS),
    ("JobCreate", "serving_formats", "maxItems", len(SERVING_FORMAT_NAMES)),
    ("JobCreate", "serving_formats", "uniqueItems", True),
    ("JobCreate", "serving_formats", "items.enum", list(SERVING_FORMAT_NAMES)),
    ("AnalyzeCreate", "include", "maxItems", MAX_PATTERNS),
    ("AnalyzeCreate", "backend", "enum", ["te", "ao"]),
]


def _keyword(prop: dict, keyword: str):
    for branch in prop.get("anyOf", [prop]):  # an optional field is anyOf [its schema, null]
        node = branch
        for part in keyword.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            return node
    return None


@pytest.mark.parametrize(("component", "prop", "keyword", "value"), SCHEMA_BOUNDS,
                         ids=[f"{c}.{p}.{k}" for c, p, k, _ in SCHEMA_BOUNDS])
def test_the_schema_states_each_bound(client, component: str, prop: str, keyword: str, value) -> None:
    spec = client.get("/openapi.json").json()
    assert _keyword(spec["components"]["schemas"][component]["properties"][prop], keyword) == value


def test_the_schema_describes_the_cross_field_bounds(client) -> None:
    description = client.get("/openapi.json").json()["components"]["schemas"]["CalibrationCreate"]["description"]
    assert str(MAX_TOKENS_PER_STEP) in description and str(MAX_CALIBRATION_TOKENS) in description
    texts = client.get("/openapi.json").json()["components"]["schemas"]["CalibrationCreate"]["properties"]["texts"]
    assert str(MAX_TEXTS_CHARS) in texts["description"]


def test_the_recipe_is_a_union_on_backend_and_scaling(client) -> None:
    spec = client.get("/openapi.json").json()
    recipe = spec["components"]["schemas"]["JobCreate"]["properties"]["recipe"]
    variants = {ref["$ref"].rsplit("/", 1)[1] for ref in recipe["anyOf"][0]["oneOf"]}
    assert variants == {"TEDelayedRecipeCreate", "TECurrentRecipeCreate", "TEMXFP8RecipeCreate",
                        "TEFloat8BlockRecipeCreate", "TENVFP4RecipeCreate", "TorchAORecipeCreate",
                        "AOFloat8TrainingOpRecipeCreate", "AOMXFP8TrainingOpRecipeCreate"}
    assert spec["components"]["schemas"]["Fp8Format"]["enum"] == ["HYBRID", "E4M3"]
    assert not [name for name in spec["components"]["schemas"] if name.startswith("_")]


LIBRARY = [  # the same bounds hold for the command line, which builds requests without the HTTP schema
    (lambda: recipes.TEDelayedScalingRecipe(amax_history_len=recipes.MAX_AMAX_HISTORY_LEN + 1), "amax_history_len"),
    (lambda: recipes.TEDelayedScalingRecipe(margin=recipes.MAX_MARGIN + 1), "margin"),
    (lambda: recipes.TEDelayedScalingRecipe(interval=recipes.MAX_INTERVAL + 1), "interval"),
    (lambda: CalibrationSettings(steps=LIMITS["steps"][1] + 1), "calibration.steps"),
    (lambda: CalibrationSettings(batch_size=4, seq_len=MAX_TOKENS_PER_STEP // 2), "calibration"),
    (lambda: CalibrationSettings(texts=["t"] * (LIMITS["texts"][1] + 1)), "calibration.texts"),
    (lambda: CalibrationSettings(texts=["t", " "]), "calibration.texts[1]"),
    (lambda: CalibrationSettings(texts=["\u2028\u00a0", "t"]), "calibration.texts[0]"),
    (lambda: ConversionRequest(model=MODEL, include=["x"] * (MAX_PATTERNS + 1)), "include"),
    (lambda: ConversionRequest(model=MODEL, exclude=["x" * (MAX_PATTERN_CHARS + 1)]), "exclude[0]"),
    (lambda: ConversionRequest(model=MODEL, serving_formats=["gguf"]), "serving_formats[0]"),
]


@pytest.mark.parametrize(("build", "field"), LIBRARY, ids=[field for _, field in LIBRARY])
def test_the_library_enforces_the_same_bounds(build, field: str) -> None:
    with pytest.raises(Fp8ForgeError) as info:
        build()
    assert info.value.field == field and info.value.code in ERROR_CODES


def test_serving_format_names_match_the_registry() -> None:
    from converters.serving import SERVING_FORMATS

    assert SERVING_FORMAT_NAMES == tuple(SERVING_FORMATS)


def test_matching_many_wildcard_segments_stays_fast() -> None:
    import time

    started = time.monotonic()
    for pattern in ("**." * 60 + "x", "**.*." * 20 + "x", "*." * 63 + "*"):
        assert not matches(pattern, "model.layers.10.self_attn.q_proj")
    assert time.monotonic() - started < 0.5  # the recursive matcher tried every split: minutes


@pytest.mark.parametrize("last_event_id", [str(MAX_EVENT_ID + 1), str(2**64), "9" * 40])
def test_a_huge_last_event_id_is_refused_or_ends_cleanly(served, last_event_id: str) -> None:
    client, settings = served
    job = client.post("/v1/jobs", json=_job()).json()
    client.post(f"/v1/jobs/{job['id']}/cancel")  # a finished job: its stream ends after the stored events
    response = client.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": last_event_id})
    spec = client.get("/openapi.json").json()
    header = next(p for p in spec["paths"]["/v1/jobs/{job_id}/events"]["get"]["parameters"]
                  if p["name"] == "Last-Event-ID")
    if "maximum" in str(header["schema"]):  # the route declares LastEventIdHeader: refused up front
        assert response.status_code == 422 and response.json()["error"]["field"] == "Last-Event-ID"
    else:  # only the stream's own guard: an empty stream that ends, never an aborted one
        assert response.status_code == 200 and response.text == ""


@pytest.mark.parametrize("bad", ["-1", "abc", "1.5"])
def test_a_malformed_last_event_id_is_422(client, bad: str) -> None:
    job = client.post("/v1/jobs", json=_job()).json()
    response = client.get(f"/v1/jobs/{job['id']}/events", headers={"Last-Event-ID": bad})
    assert response.status_code == 422 and response.json()["error"]["field"] == "Last-Event-ID"


def test_the_event_stream_clamps_what_the_store_cannot_hold(served) -> None:
    import anyio

    _, settings = served
    store = JobStore(settings.store_url)
    try:
        job, _ = store.create_job({"model": MODEL}, request_hash="clamp")
        store.set_status(job.id, JobStatus.CANCELLED)

        async def collect() -> list[str]:
            return [frame async for frame in job_event_stream(store, job.id, 2**70, poll_s=0.01)]

        assert anyio.run(collect) == []
    finally:
        store.close()
