"""The pages that answer "which recipe, and which layers hurt?", in Chromium against a real server on 127.0.0.1.

The reports are real: the demo model is converted once per module (4 calibration steps, a serving export and a
precision plan at a KL budget, which the pipeline measures end to end), and its fp8_report.json is published as a
job's artifact through the real job store. Every block shown is the conversion's own (``quality`` on held-out texts,
``plan``, ``amax_swing``); a copy without those three checks that the page says plainly that an older report has
none.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from service.config import Settings
from service.jobs import JobStatus
from service.store import JobStore
from tests.service_helpers import live_app

pytestmark = pytest.mark.slow

SERVING = "compressed-tensors-fp8"
ADDED_BLOCKS = ("quality", "plan", "amax_swing")
PLAN = {"target_kl": 0.05, "objective": "memory", "gpu": "h100"}


@pytest.fixture(scope="module")
def real_report(tmp_path_factory) -> dict[str, Any]:
    """fp8_report.json of the demo model converted with a serving export and a plan (4 steps of 2 x 64 tokens)."""
    from converters.model.sources import ModelSourceOptions
    from converters.pipeline.driver import run_conversion
    from converters.pipeline.request import CalibrationSettings, ConversionRequest

    root = tmp_path_factory.mktemp("convert")
    request = ConversionRequest(model="demo/tiny-llama", calibration=CalibrationSettings(steps=4, seq_len=64),
                                serving_formats=(SERVING,), plan=PLAN)
    result = run_conversion(request, root / "artifact", ModelSourceOptions(demo_dir=root / "demo"))
    return json.loads(result.report_path.read_text())


def holding_blocks(report: dict[str, Any]) -> dict[str, Any]:
    """The report as written, once it is known to hold the quality of both artifacts, a plan and the amax swing."""
    quality = report.get("quality") or {}
    assert quality.get("training") and SERVING in quality.get("serving", {}), quality
    assert report.get("plan", {}).get("made") and report.get("amax_swing"), "the conversion writes both blocks"
    return report


def publish(store: JobStore, jobs_dir: Path, request: dict[str, Any], report: dict[str, Any]) -> str:
    """A job driven to succeeded through the real store, with ``report`` as its fp8_report.json."""
    from service.artifacts import ArtifactDirs

    job, _ = store.create_job(request, request_hash=uuid.uuid4().hex)
    store.claim_next("test-worker")
    dirs = ArtifactDirs(jobs_dir)
    final = dirs.final_dir(job.id)
    final.mkdir(parents=True)
    (final / "fp8_report.json").write_text(json.dumps(report))
    store.set_status(job.id, JobStatus.SUCCEEDED, owner="test-worker", artifacts=dirs.index(job.id))
    return job.id


@pytest.fixture(scope="module")
def server(tmp_path_factory, real_report) -> Iterator[SimpleNamespace]:
    """An API without workers, holding three jobs: the real report with its blocks, the same without
    them (an older report), and a failed job."""
    settings = Settings(data_dir=tmp_path_factory.mktemp("accuracy") / "data", auth_disabled=True, workers=0)
    request = real_report["request"]
    with live_app(settings) as client:
        store = JobStore(settings.store_url)
        older = {k: v for k, v in real_report.items() if k not in ADDED_BLOCKS}  # as a report before them
        failed, _ = store.create_job({"model": "demo/tiny-llama", "recipe": {"backend": "ao"}},
                                     request_hash=uuid.uuid4().hex)
        store.claim_next("test-worker")
        store.set_status(failed.id, JobStatus.FAILED, owner="test-worker", error_code="calibration_failed",
                         error_message="calibration.seq_len 9000 exceeds max_position_embeddings 2048")
        jobs = SimpleNamespace(older=publish(store, settings.jobs_dir, request, older),
                               full=publish(store, settings.jobs_dir, request, holding_blocks(real_report)),
                               failed=failed.id)
        yield SimpleNamespace(api=client, base_url=str(client.base_url), jobs=jobs, report=holding_blocks(real_report))
        store.close()


def test_report_shows_sqnr_quality_plan_and_swing_and_points_lead_to_rows(server, tab):
    from playwright.sync_api import expect

    report = server.report
    measured = [layer for layer in report["analysis"]["layers"] if layer.get("sqnr_db")]
    worst = sorted(measured, key=lambda layer: layer["sqnr_db"]["output"])[:5]
    t = tab(server.base_url)
    page = t.page
    page.goto(f"/ui/jobs/{server.jobs.full}")
    expect(page.locator("#report")).to_be_visible(timeout=30_000)

    # per-layer SQNR: a column of the layer table, a chart across depth (3 series), the worst layers
    expect(page.locator("#sqnr-chart a.point")).to_have_count(3 * len(measured))
    expect(page.locator("#worst-layers li")).to_have_count(5)
    for item, layer in zip(page.locator("#worst-layers li").all(), worst, strict=True):
        expect(item).to_contain_text(f"{layer['path']}: {layer['sqnr_db']['output']:.2f} dB output")
    for layer in measured:
        row = page.locator(f'#analysis-table tr[data-path="{layer["path"]}"]')
        expect(row.locator("td").nth(6)).to_have_text(f"{layer['sqnr_db']['output']:.2f}")
    page.locator("#layers-box summary").click()  # folded on the job page
    page.click('button[data-sort="sqnr_output"]')
    expect(page.locator("#analysis-table tbody tr").first).to_have_attribute("data-path", worst[0]["path"])

    # a chart point leads to its layer's row, even when the table's filter hides that row
    page.select_option("#reason-filter", "first_linear")
    target = worst[-1]["path"]
    point = page.locator(f'#sqnr-chart a.point:has(circle[data-name="{target}"])').first
    page.locator("#sqnr-box summary").click()  # the chart is folded on the job page
    point.click()
    assert page.url.endswith(f"#layer-{target}")
    row = page.locator(f'#analysis-table tr[data-path="{target}"]')
    expect(row).to_be_in_viewport()
    expect(row).to_have_class(re.compile(r"\blinked\b"))
    expect(row).to_be_focused()

    # quality: a row per artifact, and two charts (perplexity change, KL) with a bar per artifact
    quality = report["quality"]
    entries = {"training": quality["training"], **quality["serving"]}
    expect(page.locator("#quality-table tbody tr")).to_have_count(len(entries))
    served = quality["serving"][SERVING]
    expect(page.locator("#quality-serving-" + SERVING)).to_contain_text(f"{served['perplexity']:.3f}")
    expect(page.locator("#quality-charts figure")).to_have_count(2)
    expect(page.locator("#quality-charts rect.bar")).to_have_count(2 * len(entries))

    # the plan: its target, memory and measured figures beside all-FP8 and all-bf16, each layer's precision and why
    plan = report["plan"]
    expect(page.locator("#plan")).to_contain_text(f"target_kl {PLAN['target_kl']} (met)")
    expect(page.locator("#plan-measured tbody tr")).to_have_count(3)
    expect(page.locator("#plan-measured-plan")).to_contain_text(f"{plan['measured']['plan']['perplexity']:.3f}")
    expect(page.locator("#plan-table tbody tr")).to_have_count(len(plan["layers"]))
    for layer in plan["layers"]:
        row = page.locator(f'#plan-table tr[data-path="{layer["path"]}"]')
        expect(row).to_have_attribute("data-precision", layer["precision"])
        expect(row).to_contain_text(layer["why"])
    kept = next(layer["path"] for layer in plan["layers"] if layer["precision"] == "bf16")
    swing = report["amax_swing"]["layers"]
    expect(page.locator("#swing-table tbody tr")).to_have_count(len(swing))
    largest = max(swing, key=lambda path: swing[path]["max_over_median"] or 0)
    expect(page.locator("#swing-table tbody tr").first).to_have_attribute("data-path", largest)
    expect(page.locator("#swing-table tr.swing-matters")).to_have_count(len(report["amax_swing"]["matters"]))
    page.locator("#plan-layers summary").click()
    page.locator(f'#plan-table tr[data-path="{kept}"] a').click()
    assert page.url.endswith(f"#layer-{kept}")
    t.screenshot("report_accuracy")


def test_an_older_report_says_what_it_lacks(server, tab):
    from playwright.sync_api import expect

    t = tab(server.base_url)
    page = t.page
    page.goto(f"/ui/jobs/{server.jobs.older}")
    expect(page.locator("#report")).to_be_visible(timeout=30_000)
    expect(page.locator("#quality-text")).to_contain_text("no end-to-end quality figures")
    expect(page.locator("#plan-text")).to_contain_text("No precision plan")
    expect(page.locator("#swing-text")).to_contain_text("no amax swing figures")
    expect(page.locator("#quality-table")).to_be_hidden()
    expect(page.locator("#sqnr-chart a.point")).not_to_have_count(0)  # the SQNR was measured all the same


def test_jobs_list_shows_recipe_exports_duration_and_failure(server, tab):
    from playwright.sync_api import expect

    t = tab(server.base_url)
    page = t.page
    page.goto("/ui/jobs")
    full = page.locator(f'tr[data-job-id="{server.jobs.full}"]')
    expect(full.locator("td.recipe")).to_have_text("te delayed")
    expect(full.locator("td.exports")).to_have_text(SERVING)
    expect(full.locator("td.duration")).to_have_text(re.compile(r"^(<1 s|\d+ s)$"))
    failed = page.locator(f'tr[data-job-id="{server.jobs.failed}"]')
    expect(failed.locator("td.recipe")).to_have_text("ao")
    expect(failed.locator("td.exports")).to_have_text("—")
    expect(failed.locator(".failure")).to_have_text(
        "calibration_failed: calibration.seq_len 9000 exceeds max_position_embeddings 2048")
    t.screenshot("jobs_accuracy")


def test_analyze_applies_a_recipes_shape_rule_and_compares_recipes(server, tab):
    from playwright.sync_api import expect

    t = tab(server.base_url)
    page = t.page
    page.goto("/ui/analyze")
    page.fill("#model", "demo/tiny-llama")
    page.select_option("#recipe", "te-float8-block")
    expect(page.locator("#backend-te")).to_be_hidden()  # the recipe names its backend
    page.click("#analyze-submit")
    expect(page.locator(".analysis")).to_contain_text("divisible by 128", timeout=60_000)
    expect(page.locator('#analysis-table tr[data-path="model.layers.0.self_attn.k_proj"]')).to_contain_text(
        "dim_not_divisible_by_128_for_fp8_block")
    expect(page.locator("#sqnr-text")).to_contain_text("No layer has an SQNR here")

    page.select_option("#recipe", "")
    for name in ("te-delayed", "te-mxfp8", "ao-rowwise"):
        page.check(f"#compare-{name}")
    with page.expect_response("**/v1/analyze", timeout=120_000) as answered:
        page.click("#analyze-submit")
    answer = answered.value.json()
    assert answered.value.request.post_data_json["compare_recipes"] == ["te-delayed", "te-mxfp8", "ao-rowwise"]
    expect(page.locator("#comparison-recipes tbody tr")).to_have_count(3)
    layers = answer["comparison"]["layers"]
    expect(page.locator("#comparison-table tbody tr")).to_have_count(len(layers))
    expect(page.locator("#comparison-chart a.point")).to_have_count(3 * len(layers))
    for label in ("te-delayed", "te-mxfp8", "ao-rowwise"):
        lowest = min(layers, key=lambda layer: layer["sqnr_db"][label]["output"])
        row = page.locator(f'#comparison-recipes tr[data-recipe="{label}"]')
        expect(row).to_contain_text(f"{lowest['sqnr_db'][label]['output']:.2f}")
        expect(row).to_contain_text(lowest["path"])
    # each recipe's end-to-end quality beside its SQNR (or the reason the server could not measure it)
    recipes = answer["comparison"]["recipes"]
    if any(entry.get("quality") for entry in recipes):
        for entry in recipes:
            row = page.locator(f'#comparison-recipes tr[data-recipe="{entry["label"]}"]')
            expect(row).to_contain_text(f"{entry['quality']['perplexity']:.3f}")
    else:
        expect(page.locator("#comparison-quality-text")).to_contain_text("No end-to-end quality columns")
    expect(page.locator("#sqnr-chart a.point")).not_to_have_count(0)  # the calibrated analysis has the SQNR too
    page.locator("#comparison-chart a.point").first.click()
    assert re.search(r"#cmp-model\.layers\.\d+\.", page.url)
    t.screenshot("analyze_compare")


def test_new_job_form_sends_min_sqnr_db_and_a_plan(server, tab):
    from playwright.sync_api import expect

    t = tab(server.base_url)
    page = t.page
    page.goto("/ui/jobs/new")
    page.fill("#model", "demo/tiny-llama")
    expect(page.locator("#plan-objective")).to_be_hidden()  # no plan unless a target is chosen
    page.check("#plan_target-target_kl")
    page.fill("#plan-target_kl", "50")
    page.select_option("#plan-objective", "fp8-flops")
    page.select_option("#plan-gpu", "b200")
    page.click("#submit-job")
    error = page.locator("#plan-target_kl-error")
    expect(error).to_contain_text("10")  # the API's bound, next to the field
    expect(page.locator("#plan-target_kl")).to_be_focused()

    page.fill("#plan-target_kl", "0.02")
    page.fill("#min_sqnr_db", "400")
    page.click("#submit-job")
    expect(page.locator("#min_sqnr_db-error")).to_contain_text("300")
    expect(error).to_be_hidden()
    t.screenshot("new_job_plan")

    page.fill("#min_sqnr_db", "25.5")
    page.click("#submit-job")
    page.wait_for_url(re.compile(r"/ui/jobs/[0-9a-f-]{8,}$"))
    request = server.api.get(f"/v1/jobs/{page.url.rsplit('/', 1)[1]}").json()["request"]
    assert request["min_sqnr_db"] == 25.5
    assert request["plan"] == {"target_kl": 0.02, "objective": "fp8-flops", "gpu": "b200"}
    page.get_by_role("button", name="Cancel job").click()
    expect(page.locator("#job-status")).to_have_text("cancelled")
