"""SmolLM2's conversion job te_current_fp8 of real_decoder.JOB_PARTS: it writes the serving formats given it,
each export read back by the job's own quality pass stays close to the source, and its training artifact scores
as its recipe's emulated casts. A file of its own: xdist's loadfile runs it beside the other jobs' files."""

from __future__ import annotations

import pytest

from tests.converters.quality.real_decoder import (
    JOB_PARTS,
    assert_export_within,
    assert_training_scores_as_recipe,
    recipe_figures,
    run_job,
)

RECIPE, FORMATS = JOB_PARTS["te_current_fp8"]


@pytest.fixture(scope="module")
def report(smollm_model_dir, smollm_texts, tmp_path_factory):
    return run_job(smollm_model_dir, RECIPE, FORMATS, smollm_texts, tmp_path_factory.mktemp("te_current_fp8"))


def test_the_job_writes_the_formats_it_was_given(report):
    assert sorted(report["serving"]) == sorted(FORMATS)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_serving_export_read_back_stays_close_to_the_source(report, smollm_scored, fmt):
    assert_export_within(report, fmt, smollm_scored)


def test_the_training_artifact_scores_as_its_recipe(report, smollm_source, smollm_reports, smollm_texts):
    figures = recipe_figures(smollm_source, smollm_reports, smollm_texts, [RECIPE])[RECIPE]
    assert_training_scores_as_recipe(report, figures)
