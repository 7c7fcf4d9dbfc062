"""A kv_cache job over gloo ranks: each attention layer's FP8 KV scale search runs over every rank's steps at the
layer's end, so 2 and 3 ranks write the one-process run's bytes (the KV scales in the serving export among them)
and report the same search figures; the quality pass is shared by the ranks (each scores its block of the texts,
the sums added over the ranks) and reports the one-process figures; a rank killed mid-calibration resumes from the
record, KV searches included, to the same bytes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from safetensors import safe_open

from tests.converters.distributed.conftest import Job, digests, run_one_process

LAYERS = 3
TEXTS = ["The river bends twice before it reaches the old mill by the bridge.",
         "A quiet market opens early, and the bakers sell bread to the first customers.",
         "Snow covered the valley overnight; the roads stayed closed until noon.",
         "She wrote the numbers down, checked them twice and sent the report.",
         "Wind turbines on the ridge turned slowly in the evening light."]
REPORT, MANIFEST = "fp8_report.json", "manifest.json"
#: the quality figures of several ranks are sums of the same per-position terms in another grouping, and the head's
#: logits come from GEMMs over other blocks of positions: equal to the one-process figures up to float rounding
QUALITY_REL, QUALITY_ABS = 1e-6, 1e-9


@pytest.fixture(scope="module")
def kv_job(tmp_path_factory, zygote) -> Job:
    """A three-layer Llama with the demo tokenizer (the quality pass scores text), TE delayed scaling, FP8 KV
    scales in a compressed-tensors export, and five short quality texts (a block of them for each rank)."""
    import torch
    from transformers import AutoModelForCausalLM

    from converters.model.demo import build_demo_tokenizer
    from converters.pipeline.request import CalibrationSettings, ConversionRequest
    from tests.models import tiny_config

    root = tmp_path_factory.mktemp("distributed-kv")
    tokenizer = build_demo_tokenizer()
    config = tiny_config("llama")
    config.num_hidden_layers = LAYERS
    config.vocab_size = len(tokenizer)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "llama-kv")
    tokenizer.save_pretrained(root / "llama-kv")
    request = ConversionRequest(model=str(root / "llama-kv"), recipe={"backend": "te"}, kv_cache="fp8",
                                calibration=CalibrationSettings(steps=6, batch_size=2, seq_len=32),
                                serving_formats=("compressed-tensors-fp8",), quality_texts=TEXTS)
    path = root / "request.json"
    body = {**request.to_dict(), "quality_texts": TEXTS}  # to_dict() summarises texts: the body carries them
    path.write_text(json.dumps(body), encoding="utf-8")
    return Job(root=root, request=path, zygote=zygote)


@pytest.fixture(scope="module")
def baseline(kv_job) -> Path:
    """The job run the ordinary way: one process, no rank variables (run_conversion itself)."""
    return run_one_process(kv_job, kv_job.root / "one-process", timeout=600)


def _close(got, expected, where: str) -> None:
    """``got`` equals ``expected``: numbers within the quality tolerance, everything else exactly."""
    if isinstance(expected, dict):
        assert set(got) == set(expected), where
        for key in expected:
            _close(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, float):
        assert math.isclose(got, expected, rel_tol=QUALITY_REL, abs_tol=QUALITY_ABS), (where, got, expected)
    else:
        assert got == expected, where


def assert_same_kv_result(out: Path, baseline: Path) -> dict:
    """Every file but the report and manifest the same bytes (the KV scales among them), the report the same but
    for the run's facts and the quality figures, which agree within float rounding."""
    ours, theirs = digests(out), digests(baseline)
    assert set(ours) == set(theirs)
    differing = sorted(name for name in ours if ours[name] != theirs[name])
    assert differing in ([], sorted([MANIFEST, REPORT])), differing
    report, expected = (json.loads((path / REPORT).read_text()) for path in (out, baseline))
    quality, expected_quality = report.pop("quality"), expected.pop("quality")
    for side in (report, expected):
        side.pop("stage_seconds")
        side["calibration"].pop("forward")
        for layer in side["analysis"]["layers"]:
            layer.pop("sqnr_db", None)  # sums over the ranks: test_data_parallel compares them
    assert report == expected  # the KV scales' search figures (ratios, attention errors, steps searched) exactly
    assert expected_quality["measured"], expected_quality
    for block in (quality, expected_quality):
        block.pop("seconds")
    _close(quality, expected_quality, "quality")
    return json.loads((out / REPORT).read_text())


def _kv_scales(directory: Path) -> dict[str, float]:
    scales = {}
    for path in sorted((directory / "serving" / "compressed-tensors-fp8").glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            scales.update({name: float(handle.get_tensor(name)) for name in handle.keys()
                           if name.endswith(("k_scale", "v_scale"))})
    return scales


@pytest.mark.parametrize("world_size", [2, 3])
def test_kv_scales_and_quality_of_ranks_are_the_one_process_ones(kv_job, baseline, world_size):
    out = kv_job.root / f"ranks-{world_size}"
    ranks = kv_job.start(world_size, out)
    codes = ranks.wait(timeout=600)
    assert codes == [0] * world_size, [ranks.log(rank)[-2000:] for rank in range(world_size)]
    report = assert_same_kv_result(out, baseline)
    assert len(_kv_scales(out)) == 2 * LAYERS and _kv_scales(out) == _kv_scales(baseline)
    assert report["calibration"]["forward"]["ranks"] == world_size
    assert report["quality"]["held_out"]["texts"] == len(TEXTS)


def test_a_killed_kv_rank_resumes_with_its_searches(kv_job, baseline):
    out = kv_job.root / "killed"
    kv_job.killed_after_layer_1(out, kv_job.root / f".{out.name}.resume")

    restarted = kv_job.start(3, out)
    assert restarted.wait(timeout=600) == [0, 0, 0], restarted.log(0)[-2000:]
    report = assert_same_kv_result(out, baseline)
    forward = report["calibration"]["forward"]
    assert forward["resumed_at_layer"] == 2 and forward["layers_run"] == [2] and forward["ranks"] == 3
