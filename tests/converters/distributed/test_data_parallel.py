"""Data-parallel layer-sequential calibration over gloo ranks on this machine, and its resume per layer: the artifact
and the serving export of 1, 2 and 3 ranks are the same bytes as the ordinary one-process run, and a job whose rank
is killed with SIGKILL mid-calibration resumes at the first unfinished layer and publishes those same bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.converters.distributed.conftest import LAYERS, digests

pytestmark = pytest.mark.slow  # each test starts up to three ranks and converts the model in them

REPORT, MANIFEST = "fp8_report.json", "manifest.json"


def _without_run_facts(report: dict) -> dict:
    """The report less what describes the run rather than its result: timings, ranks, layers run, and the SQNR
    figures (sums over the ranks: equal within float reordering, compared apart)."""
    report = json.loads(json.dumps(report))
    report.pop("stage_seconds")
    report["calibration"].pop("forward")
    for layer in report["analysis"]["layers"]:
        layer.pop("sqnr_db", None)
    return report


def _sqnr(report: dict) -> dict[str, dict]:
    return {layer["path"]: layer.get("sqnr_db") for layer in report["analysis"]["layers"]}


def assert_same_result(out: Path, baseline: Path) -> dict:
    """``out`` holds the bytes of ``baseline`` (every file but the report and the manifest that lists it), the
    same report but for the run's own facts, and the SQNR figures within one unit of their last place (0.01 dB)."""
    ours, theirs = digests(out), digests(baseline)
    assert set(ours) == set(theirs)
    assert any(name.startswith("serving/compressed-tensors-fp8/") and name.endswith(".safetensors") for name in ours)
    differing = sorted(name for name in ours if ours[name] != theirs[name])
    assert differing in ([], sorted([MANIFEST, REPORT])), differing
    report, expected = (json.loads((path / REPORT).read_text()) for path in (out, baseline))
    assert _without_run_facts(report) == _without_run_facts(expected)
    for path, figures in _sqnr(expected).items():
        got = _sqnr(report)[path]
        assert (got is None) == (figures is None), path
        for what, value in (figures or {}).items():
            assert (value is None and got[what] is None) or abs(got[what] - value) <= 0.011, (path, what)
    listed = {entry["name"]: entry["sha256"] for entry in json.loads((out / MANIFEST).read_text())["files"]}
    assert {name: digest for name, digest in listed.items() if name != REPORT} == \
        {name: digest for name, digest in ours.items() if name not in (REPORT, MANIFEST)}
    return report


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_publish_the_one_process_bytes(job, one_rank, world_size):
    out = job.root / f"ranks-{world_size}"
    # two ranks as new interpreters, the way torchrun and srun start them; the others forked from the zygote
    ranks = job.start(world_size, out, fresh=world_size == 2)
    codes = ranks.wait()
    assert codes == [0] * world_size, [ranks.log(rank)[-2000:] for rank in range(world_size)]
    printed = json.loads(ranks.log(0).strip().splitlines()[-1])
    assert printed["ranks"] == world_size
    report = assert_same_result(out, one_rank)
    forward = report["calibration"]["forward"]
    assert forward["ranks"] == world_size and forward["layers_run"] == list(range(LAYERS))
    assert "resumed_at_layer" not in forward
    assert not (job.root / f".{out.name}.resume").exists()  # removed once published


def test_a_killed_rank_resumes_at_the_first_unfinished_layer(job, one_rank):
    """The record is where rank 0's --resume-dir says (a service keeps one per job, across attempts); another
    rank's own --resume-dir does not count."""
    out = job.root / "killed"
    record = job.root / "record-of-the-job"
    where = {0: ["--resume-dir", str(record)], 1: ["--resume-dir", str(job.root / "not-used")],
             2: ["--resume-dir", str(job.root / "not-used")]}
    job.killed_after_layer_1(out, record, rank_args=where)
    assert not out.exists()  # nothing published
    finished = {path: path.stat().st_mtime_ns for path in record.glob("layer-*.safetensors")}

    restarted = job.start(3, out, rank_args=where)  # another allocation: another number of ranks
    assert restarted.wait() == [0, 0, 0], restarted.log(0)[-2000:]
    report = assert_same_result(out, one_rank)
    forward = report["calibration"]["forward"]
    assert forward["resumed_at_layer"] == 2 and forward["layers_run"] == [2, 3] and forward["ranks"] == 3
    assert all(not path.exists() or path.stat().st_mtime_ns == mtime for path, mtime in finished.items())
    assert not record.exists() and not (job.root / "not-used").exists()
