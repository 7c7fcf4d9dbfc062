"""The real SmolLM2 decoder as the real-decoder tests share it (tests/converters/quality/real_decoder.py): built,
opened, analysed and cut to its held-out text once per process, whichever of those files the process runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def smollm_model_dir() -> Path:
    from tests.converters.quality.smollm import smollm_dir

    return smollm_dir()


@pytest.fixture(scope="session")
def smollm_source(smollm_model_dir):
    from converters.quality import load_source

    return load_source(smollm_model_dir)


@pytest.fixture(scope="session")
def smollm_texts(smollm_source) -> list[str]:
    """The first held-out text cut to about TOKENS + 1 tokens (the jobs score up to 256 positions of their texts)."""
    from converters.quality import held_out_part
    from tests.converters.quality.real_decoder import TOKENS

    tokenizer = smollm_source.tokenizer
    ids = tokenizer(held_out_part()[0], add_special_tokens=True)["input_ids"][:TOKENS + 1]
    return [tokenizer.decode(ids, skip_special_tokens=True)]


@pytest.fixture(scope="session")
def smollm_scored(smollm_source, smollm_texts) -> int:
    """The positions a pass scores on ``smollm_texts``: the decoded cut may tokenize a token or two apart from it."""
    return len(smollm_source.tokenizer(smollm_texts[0], add_special_tokens=True)["input_ids"]) - 1


@pytest.fixture(scope="session")
def smollm_reports(smollm_model_dir) -> dict[str, dict[str, Any]]:
    """Each recipe of ``RECIPE_NAMES`` -> its analysis of the model."""
    from converters.api import analyze, local_sources
    from converters.recipes.presets import RECIPE_NAMES, parse_compare_recipe

    sources = local_sources(smollm_model_dir.parent)
    return {name: analyze(str(smollm_model_dir), recipe=parse_compare_recipe(name, "recipe"), sources=sources)
            for name in RECIPE_NAMES}


@pytest.fixture(scope="session")
def smollm_recipe_figures(smollm_source, smollm_reports, smollm_texts):
    """Each recipe that converts something -> the quality of its emulated casts, all in one pass."""
    from tests.converters.quality.real_decoder import NOT_ELIGIBLE, recipe_figures

    return recipe_figures(smollm_source, smollm_reports, smollm_texts,
                          [name for name in smollm_reports if name not in NOT_ELIGIBLE])
