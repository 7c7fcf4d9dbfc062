"""The web UI's server side: pages, their files, the setting that turns them off, the YAML recipe helper.

What the pages do in a browser is tested in tests/service/ui/test_ui_browser.py.
"""

from __future__ import annotations

import fnmatch
import re
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from service.api.auth import hash_token
from service.config import Settings, load_settings
from service.main import create_app
from service.ui.routes import STATIC_DIR

UI_DIR = STATIC_DIR.parent
PAGES = ["/ui/jobs", "/ui/jobs/new", "/ui/analyze", "/ui/jobs/0123abcd"]
TOKEN = "fp8f_ui-test-token"


@pytest.fixture
def client(tmp_path):
    with TestClient(create_app(Settings(data_dir=tmp_path, auth_disabled=True))) as client:
        yield client


class _Assets(HTMLParser):
    """Every URL a page loads: scripts, stylesheets, icons."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []
        self.inline_scripts = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script" and attrs.get("type") != "application/json":
            if attrs.get("src"):
                self.urls.append(attrs["src"])
            else:
                self.inline_scripts += 1
        if tag == "link":
            self.urls.append(attrs["href"])


@pytest.mark.parametrize("path", PAGES)
def test_pages_load_only_their_own_files(client, path):
    page = client.get(path)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assets = _Assets()
    assets.feed(page.text)
    assert assets.inline_scripts == 0  # the CSP forbids them; Alpine's CSP build needs none
    for url in assets.urls:
        if url.startswith("data:"):
            continue
        assert url.startswith("/ui/static/"), url
        assert client.get(url).status_code == 200, url


def test_ui_redirects_to_the_jobs_list(client):
    answer = client.get("/ui", follow_redirects=False)
    assert answer.status_code == 307 and answer.headers["location"] == "/ui/jobs"


def test_no_file_of_the_ui_names_another_origin():
    own = [p for p in UI_DIR.rglob("*")
           if p.is_file() and "vendor" not in p.parts and p.suffix in (".html", ".js", ".css")]
    assert own
    for path in own:
        # the SVG namespace is a name createElementNS needs, never fetched
        text = path.read_text().replace("'http://www.w3.org/2000/svg'", "")
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text), path


def test_every_vendored_file_is_listed_with_its_licence():
    vendor = STATIC_DIR / "vendor"
    readme = (vendor / "README.md").read_text()
    for path in vendor.glob("*.min.*"):
        assert path.name in readme, path.name
    assert {p.name for p in vendor.glob("LICENSE.*")} >= {"LICENSE.alpinejs.txt", "LICENSE.uplot.txt",
                                                          "LICENSE.vue-reactivity.txt"}


def test_package_data_ships_every_ui_file():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((Path(__file__).parents[3] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["service.ui"]
    for path in UI_DIR.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".py":
            name = path.relative_to(UI_DIR).as_posix()
            assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name


@pytest.mark.parametrize("env", ["0", "false"])
def test_ui_enabled_off_serves_no_page(tmp_path, monkeypatch, env):
    monkeypatch.setenv("FP8FORGE_UI_ENABLED", env)
    settings = load_settings(data_dir=tmp_path, auth_disabled=True)
    assert settings.ui_enabled is False
    with TestClient(create_app(settings)) as client:
        for path in ["/ui/jobs", "/ui/static/js/api.js"]:
            answer = client.get(path)
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"
        assert client.get("/v1/jobs").status_code == 200


def test_ui_routes_stay_out_of_the_api_contract(client):
    assert not [path for path in client.get("/openapi.json").json()["paths"] if path.startswith("/ui")]


ACCELERATE_YAML = """\
compute_environment: LOCAL_MACHINE
mixed_precision: fp8
fp8_config:
  backend: TE
  fp8_format: E4M3
  amax_history_length: 32
  amax_compute_algorithm: most_recent
"""


def test_yaml_helper_returns_the_recipe_object_the_api_takes(client):
    answer = client.post("/ui/api/recipe-from-yaml", json={"yaml": ACCELERATE_YAML})
    assert answer.status_code == 200
    recipe = answer.json()["recipe"]
    assert recipe == {"version": 1, "backend": "te", "scaling": "delayed", "fp8_format": "E4M3",
                      "amax_history_len": 32, "amax_compute_algo": "most_recent", "margin": 0,
                      "use_autocast_during_eval": False}
    job = client.post("/v1/jobs", json={"model": "demo/tiny-llama", "recipe": recipe})
    assert job.status_code == 202, job.text


@pytest.mark.parametrize(("text", "words"), [
    (ACCELERATE_YAML.replace("32", "5000"), "amax_history_len must be an integer >= 1 and <= 4096"),
    ("mixed_precision: bf16\n", "mixed_precision: fp8"),
    ("mixed_precision: fp8\nfp8_config: [\n", "Not valid YAML"),
])
def test_yaml_helper_names_the_box_and_the_yaml_key(client, text, words):
    answer = client.post("/ui/api/recipe-from-yaml", json={"yaml": text})
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["code"] == "invalid_recipe" and error["field"] == "yaml" and words in error["message"]


def test_yaml_helper_needs_a_key_where_keys_are_on(tmp_path):
    settings = Settings(data_dir=tmp_path, api_keys=(f"alice:user:{hash_token(TOKEN)}",))
    with TestClient(create_app(settings)) as client:
        assert client.get("/ui/jobs").status_code == 200  # the page holds no data
        refused = client.post("/ui/api/recipe-from-yaml", json={"yaml": ACCELERATE_YAML})
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        answer = client.post("/ui/api/recipe-from-yaml", json={"yaml": ACCELERATE_YAML},
                             headers={"Authorization": f"Bearer {TOKEN}"})
        assert answer.status_code == 200


class _Controls(HTMLParser):
    """The form controls of a page by id: their attributes, and for a select the option marked selected."""

    def __init__(self) -> None:
        super().__init__()
        self.controls: dict[str, dict] = {}
        self.options: dict[str, list[str]] = {}  #: a select's option values, in order
        self.variants: set[str] = set()
        self.fields: set[str] = set()  #: every data-field: where the API's errors (and so its fields) land
        self._select: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-recipe-variant" in attrs:
            self.variants.add(attrs["data-recipe-variant"])
        if "data-field" in attrs:
            self.fields.add(attrs["data-field"])
        if tag in ("input", "select") and attrs.get("id"):
            self.controls[attrs["id"]] = attrs
            self._select = attrs["id"] if tag == "select" else None
        if tag == "option" and self._select:
            self.options.setdefault(self._select, []).append(attrs.get("value"))
            if "selected" in attrs:
                self.controls[self._select]["selected"] = attrs["value"]


def test_the_form_offers_every_recipe_of_the_api_schema_with_its_defaults(client):
    """Each recipe in the OpenAPI document (beyond the three with hand-written fields) has a box of options; an option
    every recipe has is one control for all (``recipe-<name>``); every field of every recipe has a place on the form
    (what each form sends: test_ui_browser.py)."""
    components = client.get("/openapi.json").json()["components"]["schemas"]
    page = _Controls()
    page.feed(client.get("/ui/jobs/new").text)
    recipes = [schema for schema in components.values() if "const" in schema.get("properties", {}).get("backend", {})]
    assert len(recipes) == 8
    shared = set.intersection(*(set(schema["properties"]) for schema in recipes)) - {"version", "backend", "scaling"}
    assert shared == {"nvfp4_weight_scales", "nvfp4_weight_rounding", "nvfp4_smoothing"}
    for schema in recipes:
        assert {f"recipe.{name}" for name in schema["properties"]} - {"recipe.version"} <= page.fields, schema["title"]
    offered = 0
    for schema in components.values():
        scaling = schema.get("properties", {}).get("scaling", {}).get("const")
        if scaling is None or scaling in ("delayed", "current"):
            continue
        backend = schema["properties"]["backend"]["const"]
        assert f"{backend}/{scaling}" in page.variants
        for name, prop in schema["properties"].items():
            if name in ("version", "backend", "scaling"):
                continue
            control = page.controls[f"recipe-{name}" if name in shared else f"recipe-{scaling}-{name}"]
            assert control["data-option"] == name
            if control.get("type") == "checkbox":
                assert ("checked" in control) is prop["default"], name
            elif control.get("type") == "number":
                assert [float(control[k]) for k in ("value", "min", "max")] == \
                    [prop["default"], prop["minimum"], prop["maximum"]], name
            else:
                assert control["selected"] == prop["default"], name
        offered += 1
    assert offered == 5  # TE mxfp8_block, float8_block, nvfp4_block; torchao float8/mxfp8 training ops
    for name in shared:  # one control, not a copy per recipe
        assert not any(control.endswith(f"-{name}") and control != f"recipe-{name}" for control in page.controls)


def test_the_forms_offer_the_plan_and_the_recipes_the_api_schema_names(client):
    """The new-job form's plan (targets with their bounds, objectives, GPUs) and the analyze form's recipes (the
    recipe choice and compare_recipes) are the ones the OpenAPI document states."""
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    plan = schemas["PlanCreate"]["properties"]
    job_form = _Controls()
    job_form.feed(client.get("/ui/jobs/new").text)
    targets = [name for name in plan if name not in ("objective", "gpu")]
    assert {c.removeprefix("plan_target-") for c in job_form.controls if c.startswith("plan_target-")} == \
        {"none", *targets}
    for name in targets:
        bounds = next(option for option in plan[name]["anyOf"] if option.get("type") == "number")
        control = job_form.controls[f"plan-{name}"]
        assert (float(control["min"]), float(control["max"]), control["step"]) == \
            (bounds["minimum"], bounds["maximum"], "any")
    for name in ("objective", "gpu"):
        choices = next(option for option in plan[name]["anyOf"] if "enum" in option)["enum"]
        assert job_form.options[f"plan-{name}"] == choices
    assert job_form.controls["min_sqnr_db"]["step"] == "any"

    analyze_form = _Controls()
    analyze_form.feed(client.get("/ui/analyze").text)
    names = schemas["AnalyzeCreate"]["properties"]["compare_recipes"]["anyOf"][0]["items"]["enum"]
    assert analyze_form.options["recipe"] == ["", *names]
    assert [c.removeprefix("compare-") for c in analyze_form.controls if c.startswith("compare-")] == names


@pytest.mark.parametrize(("recipe", "reason"), [
    ({"backend": "te", "scaling": "float8_block"}, "dim_not_divisible_by_128_for_fp8_block"),
    ({"backend": "te", "scaling": "nvfp4_block"}, "dim_not_divisible_by_128_for_nvfp4"),
])
def test_analyze_applies_the_shape_rule_of_the_recipe_it_is_given(client, recipe, reason):
    """The analyze page sends a recipe; the API applies its shape rule (the demo model's 64-wide k_proj fails 128)."""
    answer = client.post("/v1/analyze", json={"model": "demo/tiny-llama", "recipe": recipe})
    assert answer.status_code == 200, answer.text
    report = answer.json()
    assert report["options"]["recipe"]["scaling"] == recipe["scaling"] and "128" in report["rule"]
    k_proj = next(layer for layer in report["layers"] if layer["path"] == "model.layers.0.self_attn.k_proj")
    assert reason in k_proj["reasons"] and not k_proj["eligible"]
    default = client.post("/v1/analyze", json={"model": "demo/tiny-llama"}).json()
    assert next(layer for layer in default["layers"] if layer["path"] == k_proj["path"])["eligible"]


def test_analyze_refuses_a_backend_that_is_not_the_recipes(client):
    answer = client.post("/v1/analyze", json={"model": "demo/tiny-llama", "backend": "te", "recipe": {"backend": "ao"}})
    assert answer.status_code == 422
    error = answer.json()["error"]
    assert error["field"] == "backend" and "recipe.backend is 'ao'" in error["message"]
