"""Every job kind in the UI, in Chromium against `fp8forge serve` with a real worker on 127.0.0.1.

The demo model converted three ways by the worker: a calibrated job with a serving export, the same with a precision
plan, and a requantize job submitted from its own form (its shard tasks run by the worker). Each job's page shows
the report of its kind, a requantize job's page its tasks (which worker ran which shard); every page stays under
2,500 px tall, and the jobs list labels each kind, breaks paths only between their parts and shows a 12-line error
as one line with the whole text in its tooltip and on the job's page. Screenshots: jobs_kinds, job_calibrated,
job_requantize, job_plan.
"""

from __future__ import annotations

import re
import tarfile
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from service.config import Settings
from service.jobs import JobStatus
from service.store import JobStore
from tests.service_helpers import ServeProcess, wait_for

pytestmark = pytest.mark.slow

MAX_PAGE_PX = 2500  # the bound for the demo model's pages
SERVING = "compressed-tensors-fp8"
CALIBRATION = {"steps": 4, "batch_size": 2, "seq_len": 64}
LONG_PATH = "/srv/models/some-organisation/checkpoints/Meta-Llama-3.1-8B-Instruct-bf16-v2"
LONG_ERROR = "\n".join(f"line {i}: the worker's traceback goes on and on about what happened" for i in range(12))


def _failed_job(settings: Settings) -> str:
    """A failed job with a 12-line error, in the store before any worker runs (so none claims it)."""
    store = JobStore(settings.store_url)
    try:
        job, _ = store.create_job({"model": LONG_PATH, "recipe": {"backend": "ao"}}, request_hash=uuid.uuid4().hex)
        store.claim_next("test-worker")
        store.set_status(job.id, JobStatus.FAILED, owner="test-worker", error_code="conversion_failed",
                         error_message=LONG_ERROR)
        return job.id
    finally:
        store.close()


def _submit(api: httpx.Client, body: dict[str, Any]) -> str:
    answer = api.post("/v1/jobs", json=body)
    assert answer.status_code == 202, answer.text
    return answer.json()["id"]


def _finished(api: httpx.Client, job_id: str) -> dict[str, Any] | None:
    job = api.get(f"/v1/jobs/{job_id}").json()
    return job if job["status"] in ("succeeded", "failed", "cancelled") else None


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[SimpleNamespace]:
    """`fp8forge serve` with one worker, no keys; a calibrated and a plan job queued at once, a failed one stored."""
    data = tmp_path_factory.mktemp("kinds") / "data"
    failed = _failed_job(Settings(data_dir=data, auth_disabled=True))
    env = {"FP8FORGE_HEARTBEAT_INTERVAL_S": "0.5", "FP8FORGE_POLL_INTERVAL_S": "0.2"}
    with ServeProcess(data, workers=1, env=env) as serve, serve.client() as api:
        common = {"model": "demo/tiny-llama", "calibration": CALIBRATION, "serving_formats": [SERVING]}
        calibrated = _submit(api, common)
        plan = _submit(api, {**common, "plan": {"target_kl": 0.05}})
        yield SimpleNamespace(serve=serve, api=api, base_url=serve.base_url, calibrated=calibrated, plan=plan,
                              failed=failed)


def _wait(server: SimpleNamespace, job_id: str) -> dict[str, Any]:
    job = wait_for(lambda: _finished(server.api, job_id), timeout=600, what=f"job {job_id}\n{server.serve.tail()}")
    assert job["status"] == "succeeded", (job, server.serve.tail())
    return job


def _height(page: Any) -> int:
    return page.evaluate("document.documentElement.scrollHeight")


def test_a_requantize_job_from_its_form_shows_its_tasks_and_its_report(server, tab):
    from playwright.sync_api import expect

    t = tab(server.base_url)
    page = t.page
    page.goto("/ui/jobs/new")
    page.locator("#job-kinds").get_by_role("link", name="requantize job").click()
    page.wait_for_url("**/ui/jobs/new/requantize")
    page.fill("#model", "demo/tiny-llama")
    page.select_option("#requantize-to", "fp8-block")
    page.click("#submit-job")
    page.wait_for_url(re.compile(r"/ui/jobs/[0-9a-f-]{8,}$"))
    job_id = page.url.rsplit("/", 1)[1]
    job = server.api.get(f"/v1/jobs/{job_id}").json()
    assert job["kind"] == "requantize" and job["request"]["requantize"] == {"to": "fp8-block"}
    expect(page.locator("#job-kind")).to_have_text("requantize")
    _wait(server, job_id)
    expect(page.locator("#job-status")).to_have_text("succeeded", timeout=30_000)

    # which worker ran which task: the API's list, row by row
    tasks = server.api.get(f"/v1/jobs/{job_id}/tasks").json()["data"]
    assert [task["kind"] for task in tasks] == ["plan", "write", "finish"]
    rows = page.locator("#tasks-table tbody tr")
    expect(rows).to_have_count(len(tasks))
    for row, task in zip(rows.all(), tasks, strict=True):
        expect(row).to_have_attribute("data-task", task["name"])
        expect(row).to_have_attribute("data-status", "succeeded")
        expect(row).to_contain_text(task["worker"])
        expect(row).to_contain_text(task["host"])  # no API keys: the local caller sees hosts
    expect(page.locator("#tasks-text")).to_contain_text("3 of 3 tasks succeeded, run by 1 worker(s).")

    # the requantize report, not "no report file", and no calibrated report
    expect(page.locator("#requantize-report")).to_be_visible()
    expect(page.locator("body")).not_to_contain_text("This job has no report file")
    expect(page.locator("#report")).to_be_hidden()
    job = server.api.get(f"/v1/jobs/{job_id}").json()
    assert job["links"]["report"] == f"/v1/jobs/{job_id}/artifacts/requantize_report.json"
    report = server.api.get(job["links"]["report"]).json()
    expect(page.locator("#requantize-facts")).to_contain_text(
        f"{len(report['quantized'])} of {len(report['layers'])} Linear weights")
    expect(page.locator("#requantize-shards tbody tr")).to_have_count(len(report["shards"]))
    expect(page.locator("#requantize-worst li")).to_have_count(5)
    assert _height(page) < MAX_PAGE_PX
    t.screenshot("job_requantize")
    page.locator("#requantize-layers-box summary").click()
    expect(page.locator("#requantize-layers tbody tr")).to_have_count(len(report["layers"]))


def test_a_calibrated_jobs_page_is_compact_with_quality_deltas_and_a_download_of_everything(server, tab):
    from playwright.sync_api import expect

    job = _wait(server, server.calibrated)
    report = server.api.get(job["links"]["report"]).json()
    t = tab(server.base_url)
    page = t.page
    page.goto(f"/ui/jobs/{server.calibrated}")
    expect(page.locator("#report")).to_be_visible(timeout=30_000)
    expect(page.locator("#job-kind")).to_have_text("calibrated")
    expect(page.locator("#tasks")).to_be_hidden()  # not split into tasks (a one-process serving export)
    expect(page.locator("#sqnr-chart a.point")).not_to_have_count(0)  # drawn: the page has its full height
    assert _height(page) < MAX_PAGE_PX
    t.screenshot("job_calibrated")

    # quality as a table with the change against the source, the charts' bars named by artifact
    quality = report["quality"]
    served = quality["serving"][SERVING]
    change = served["perplexity"] - served["perplexity_reference"]
    row = page.locator(f"#quality-serving-{SERVING}")
    expect(row.locator("td.delta")).to_have_text(re.compile(
        rf"^[+−]{abs(change):.3f} \([+−]{abs(100 * change / served['perplexity_reference']):.2f}%\)$"))
    page.locator("#quality summary").click()
    labels = page.locator("#quality-ppl-chart rect.bar").evaluate_all("(bars) => bars.map(b => b.dataset.label)")
    assert labels == ["training", SERVING]

    # where each export loads, from the report's loads_in cells (when the report has them)
    cells = report["serving"][SERVING].get("loads_in") or []
    serving_row = page.locator(f'#serving-exports tr[data-format="{SERVING}"] td.loads-in li')
    expect(serving_row).to_have_count(len(cells))
    for item, cell in zip(serving_row.all(), cells, strict=True):
        expect(item).to_have_text(f"{cell['consumer']}: {cell['status']}")

    # the layer tables are folded; a link to a layer opens its table at the row
    expect(page.locator("#analysis-table")).to_be_hidden()
    page.locator("#worst-layers a").first.click()
    expect(page.locator("#analysis-table tr.linked")).to_be_in_viewport()

    # download all: one tar of exactly the listed files
    listing = server.api.get(f"/v1/jobs/{server.calibrated}/artifacts").json()["data"]
    with page.expect_download() as download:
        page.click("#download-all")
    assert download.value.suggested_filename == f"fp8forge-job-{server.calibrated}.tar"
    with tarfile.open(download.value.path()) as archive:
        names = sorted(member.name for member in archive.getmembers())
    assert names == sorted(f"{server.calibrated}/{entry['name']}" for entry in listing)


def test_a_plan_jobs_page_is_marked_and_compact(server, tab):
    from playwright.sync_api import expect

    job = _wait(server, server.plan)
    assert job["kind"] == "plan"
    t = tab(server.base_url)
    page = t.page
    page.goto(f"/ui/jobs/{server.plan}")
    expect(page.locator("#report")).to_be_visible(timeout=30_000)
    expect(page.locator("#job-kind")).to_have_text("calibrated + plan")
    expect(page.locator("#plan")).to_contain_text("target_kl 0.05")
    assert _height(page) < MAX_PAGE_PX
    t.screenshot("job_plan")
    expect(page.locator("#plan-measured tbody tr")).to_have_count(3)
    expect(page.locator("#plan-table")).to_be_hidden()
    page.locator("#plan-layers summary").click()
    expect(page.locator("#plan-table tbody tr")).not_to_have_count(0)


def test_the_jobs_list_labels_kinds_keeps_paths_whole_and_errors_on_one_line(server, tab):
    from playwright.sync_api import expect

    _wait(server, server.plan)  # every job has run
    # the form test makes a requantize job when it runs on this test process first; under xdist it may not
    listed = server.api.get("/v1/jobs").json()["data"]
    if not any(j["kind"] == "requantize" for j in listed):
        created = server.api.post("/v1/jobs", json={"model": "demo/tiny-llama", "requantize": {"to": "fp8-block"}})
        assert created.status_code == 202, created.text
        _wait(server, created.json()["id"])
    t = tab(server.base_url)
    page = t.page
    page.goto("/ui/jobs")
    kinds = {server.calibrated: "calibrated", server.plan: "plan", server.failed: "calibrated"}
    for job_id, label in kinds.items():
        expect(page.locator(f'tr[data-job-id="{job_id}"] td.kind')).to_have_text(label)
    requantize = page.locator("tr[data-job-id]").filter(
        has=page.locator("td.kind", has_text=re.compile(r"^\s*requantize\s*$")))
    expect(requantize).to_have_count(1)
    expect(requantize.locator("td.recipe")).to_have_text("no recipe")
    expect(requantize.locator("td.exports")).to_have_text("fp8-block")

    failed = page.locator(f'tr[data-job-id="{server.failed}"]')
    failure = failed.locator(".failure")
    expect(failure).to_have_attribute("title", f"conversion_failed: {LONG_ERROR}")
    expect(failure).to_have_text(re.compile(r"^conversion_failed: line 0: .*…$"))
    line = failure.evaluate("(el) => parseFloat(getComputedStyle(el).lineHeight)")
    assert failure.bounding_box()["height"] < 1.5 * line
    # the path breaks between its parts only: every part is on one line
    parts = failed.locator("td.model .seg")
    expect(parts).to_have_count(LONG_PATH.count("/") + 1)
    heights = parts.evaluate_all("(segs) => segs.map(s => s.getBoundingClientRect().height)")
    assert max(heights) < 1.5 * min(heights)
    assert "".join(parts.all_text_contents()) == LONG_PATH
    t.screenshot("jobs_kinds")
    assert _height(page) < MAX_PAGE_PX
    widths = page.locator("table.jobs thead th").evaluate_all(
        "(cells) => cells.map(c => c.textContent.trim() + ' ' + Math.round(c.getBoundingClientRect().width))")
    assert page.evaluate("document.documentElement.scrollWidth") <= 1280, widths  # no sideways scrolling

    # the whole error is on the job's page
    failure.locator("a").click()
    expect(page.locator(".error-box")).to_contain_text("line 11: the worker's traceback")
