"""The requantize form's "measure" box, in Chromium: checked by default (the request stays {to}: the API measures),
unchecked it sends `requantize.measure: false`, which the job's plan task receives."""

from __future__ import annotations

import re
from pathlib import Path

from service.config import Settings
from service.store import JobStore
from service.workers.task_kinds import plan_payload
from tests.service_helpers import live_app


def _submitted(page, measure: bool) -> str:
    page.goto("/ui/jobs/new/requantize")
    page.fill("#model", "demo/tiny-llama")
    page.select_option("#requantize-to", "compressed-tensors-fp8-dynamic")
    assert page.is_checked("#requantize-measure")
    if not measure:
        page.uncheck("#requantize-measure")
    page.click("#submit-job")
    page.wait_for_url(re.compile(r"/ui/jobs/[0-9a-f-]{8,}$"))
    return page.url.rsplit("/", 1)[1]


def test_the_measure_box_reaches_the_plan_task(tmp_path: Path, tab) -> None:
    settings = Settings(data_dir=tmp_path / "data", auth_disabled=True, workers=0)
    with live_app(settings) as client:
        page = tab(str(client.base_url)).page
        measured, unmeasured = _submitted(page, True), _submitted(page, False)
        requests = {job_id: client.get(f"/v1/jobs/{job_id}").json()["request"]["requantize"]
                    for job_id in (measured, unmeasured)}
    assert requests == {measured: {"to": "compressed-tensors-fp8-dynamic"},
                        unmeasured: {"to": "compressed-tensors-fp8-dynamic", "measure": False}}
    store = JobStore(settings.store_url)
    try:
        assert [plan_payload(store.get_job(job_id).request)["measure"] for job_id in (measured, unmeasured)] == [
            True, False]
    finally:
        store.close()
