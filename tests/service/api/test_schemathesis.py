"""Schemathesis against the API's own OpenAPI schema, on a real uvicorn with a real SQLite store and no worker.

Every operation gets schema-valid and schema-invalid requests (examples, boundary values, random data, with a
fixed seed). It fails on any 5xx, a response that breaks the schema (body, status code, content type,
headers), an invalid request the server accepts, and a valid one it refuses for a reason the schema could
have stated. Jobs only queue: no worker runs, and the only model that exists is demo/tiny-llama.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, example, settings
from schemathesis.config import SchemathesisConfig
from schemathesis.generation.hypothesis import builder

from service.config import Settings
from service.store import JobStore
from tests.service_helpers import live_app, publish_job

# pytest 9 gives every operation's test the same node id; tests/scheduling.py's unique_ids gives each its operation
# ("...[POST /v1/jobs]"), without which xdist's loadfile, which keys its work by node id, would run one of them.
pytestmark = pytest.mark.slow  # spawns processes or servers: seconds each

# A schema-valid request may still be refused for what no JSON Schema can say: whether the model exists,
# and the rules that tie two fields together. These, and only these, may answer 422 to valid data.
SEMANTIC_REFUSALS = {
    ("invalid_model_reference", "model"),
    ("model_not_found", "model"),
    ("invalid_calibration", "calibration"),  # batch_size x seq_len, steps x batch_size x seq_len
    ("invalid_calibration", "calibration.texts"),  # all texts together
    ("invalid_recipe", "recipe.enable_fsdp_float8_all_gather"),  # only with recipe_name tensorwise
    ("invalid_recipe", "recipe.w_block_scaling_dim"),  # TE: no GEMM of two 128x128-block operands
    ("invalid_recipe", "recipe.grad_block_scaling_dim"),  # likewise
    ("invalid_recipe", "recipe.nvfp4_4over6"),  # activations/all need disable_rht
    ("invalid_request", "kv_cache"),  # needs a serving format that writes KV-cache scales
    ("invalid_request", "measure"),  # false, with min_sqnr_db or compare_recipes (they need the measurement)
    ("invalid_request", "backend"),  # analyze: a backend sent beside a recipe of another backend
    ("invalid_request", "quality_texts"),  # with measure false (no quality pass to read them)
    ("invalid_request", "plan"),  # exactly one target of the three the schema lists
    ("invalid_request", "slurm"),  # Slurm options on a server whose executor is not Slurm
}
@schemathesis.check
def valid_data_refused_only_for_semantic_reasons(ctx, response, case) -> None:
    """Like positive_data_acceptance, but a 422 for one of SEMANTIC_REFUSALS is an answer, not a failure."""
    if case.meta is None or not case.meta.generation.mode.is_positive or response.status_code not in (400, 422):
        return None
    error = response.json().get("error", {})
    field = str(error.get("field", ""))
    body = case.body if isinstance(case.body, dict) else {}
    semantic = (error.get("code"), field) in SEMANTIC_REFUSALS or (
        error.get("code") == "invalid_pattern" and field.startswith("include[")) or (  # matches no Linear
        # a requantize job refuses the fields of a calibrated conversion sent beside it
        error.get("code") == "invalid_request" and body.get("requantize") and field in body)
    assert semantic, f"schema-valid request refused: {response.status_code} {error}"
    return None


def _settings(data_dir: Path) -> Settings:
    models = data_dir.parent / "models"
    # heartbeat_timeout_s: the one heartbeat the fixture sends keeps /readyz at 200 for the whole run
    return Settings(data_dir=data_dir, allowed_model_roots=(models,), workers=0, auth_disabled=True,
                    hf_offline=True, max_queued_jobs_per_key=100_000, heartbeat_timeout_s=3600)


def _load_schema():
    from service.main import create_app

    config = SchemathesisConfig.from_dict({
        "seed": 20261130,
        # with-security-parameters off: the app runs with authentication off (tests/service/api/test_auth.py tests keys)
        # max-examples bounds the fuzzing phase only: the coverage phase still sends every boundary and
        # schema-violating case the schema defines (some 700 for /v1/analyze, 160 real analyses among them), and
        # each operation still gets 50 random cases; 150 made the random phase the larger part of most operations'
        # time.
        "generation": {"mode": "all", "deterministic": True, "max-examples": 50, "with-security-parameters": False},
        "phases": {"stateful": {"enabled": False}},
        # replaced by valid_data_refused_only_for_semantic_reasons; and the two checks that probe
        # authentication do not apply with it off
        "checks": {"positive_data_acceptance": {"enabled": False}, "ignored_auth": {"enabled": False},
                   "missing_required_header": {"enabled": False}},
    })
    # the app's own schema; building the app touches no file (the store opens when it starts serving)
    spec = create_app(_settings(Path("/nonexistent/fp8forge/data"))).openapi()
    return schemathesis.openapi.from_dict(spec, config=config)


class _CoverageCases(list):
    """One operation's explicit examples, with its coverage cases generated the first time Hypothesis reads them.

    Schemathesis builds every operation's coverage cases when pytest collects the test (about 17 s of CPU for
    this schema), and every xdist worker collects the whole suite, though one of them runs this file: deferred to
    the first read, in the test's call, the worker that runs an operation builds its cases, the others never do.
    The cases are the same ones, appended after the schema's own examples as the eager build appends them, and
    built in the order the operations run, which is the order collected (schemathesis gives each path's probes of
    undeclared methods to the first of its operations built): each operation's cases, compared by the sha256 of
    their reprs, equal the eager build's (docs/benchmarks/test-suite-2026-12-03f.md)."""

    def __init__(self, examples, generate) -> None:
        super().__init__(examples)
        self._generate = generate

    def _fill(self) -> None:
        if self._generate is not None:
            generate, self._generate = self._generate, None
            generate()  # appends to this list: schemathesis' add_coverage, through hypothesis.example

    def __iter__(self):
        self._fill()
        return super().__iter__()

    def __reversed__(self):
        self._fill()
        return super().__reversed__()

    def __len__(self) -> int:
        self._fill()
        return super().__len__()

    def __bool__(self) -> bool:
        return len(self) > 0

    def __getitem__(self, index):
        self._fill()
        return super().__getitem__(index)


_eager_add_coverage = getattr(builder, "add_coverage", None)  # None: a schemathesis that builds them elsewhere


def _deferred_add_coverage(test, *args, **kwargs):
    test.hypothesis_explicit_examples = _CoverageCases(getattr(test, "hypothesis_explicit_examples", ()),
                                                       lambda: _eager_add_coverage(test, *args, **kwargs))
    return test


def _examples_live_on_the_test() -> bool:
    """Whether hypothesis still keeps a test's explicit examples in the list the deferral wraps: where a release of
    hypothesis or schemathesis moves them, the cases are built eagerly as before, never dropped."""
    @example(0)
    def probe(value) -> None: ...
    return isinstance(getattr(probe, "hypothesis_explicit_examples", None), list)


if _eager_add_coverage is not None and _examples_live_on_the_test():
    builder.add_coverage = _deferred_add_coverage  # create_test looks it up when pytest collects the tests below

schema = _load_schema()


@dataclass(frozen=True)
class Served:
    base_url: str
    job_id: str  #: a succeeded job, so that reads of a job reach its artifacts and its (finished) event stream
    artifact: str


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Served:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "models").mkdir()
    settings_ = _settings(root / "data")
    with live_app(settings_) as client:
        store = JobStore(settings_.store_url)
        store.workers.heartbeat("fuzz-worker")  # a live worker, as /readyz wants; it never claims a job
        job = publish_job(store, settings_.jobs_dir, {"model.safetensors": bytes(range(256)) * 16})
        store.close()
        # The first analysis starts its process (torch and transformers imports: seconds on a busy machine);
        # started here, so the fuzzed requests meet a warm pool and their 10 s timeout measures the API.
        # On a machine loaded far past its cores the process may miss the API's start-up limit; the answer (503,
        # analysis_aborted) says to retry, and so does this, once.
        for _ in range(2):
            warm = client.post("/v1/analyze", json={"model": "demo/tiny-llama"}, timeout=180)
            if warm.status_code != 503 or warm.json()["error"]["code"] != "analysis_aborted":
                break
        assert warm.status_code == 200, warm.text
        served_schema = client.get("/openapi.json").json()
        assert served_schema == schema.raw_schema, "the served schema differs from the one fuzzed"
        yield Served(str(client.base_url), job.id, "model.safetensors")


# Reads of one job: valid requests name the published job (a random id is only ever 404), so that Range and
# Last-Event-ID meet a real file and a real event log; invalid ones keep what was generated.
_JOB_READS = {"getJob", "streamJobEvents", "listArtifacts", "downloadArtifact", "headArtifact"}


@schema.parametrize()
@settings(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
def test_api_conforms_to_its_schema(case, served: Served) -> None:
    if case.operation.definition.raw.get("operationId") in _JOB_READS and case.meta.generation.mode.is_positive:
        case.path_parameters["job_id"] = served.job_id
        if "name" in case.path_parameters:
            case.path_parameters["name"] = served.artifact
    case.call_and_validate(base_url=served.base_url, timeout=10)
