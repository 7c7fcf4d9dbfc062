"""The real SmolLM2 decoder as the real-decoder tests share it (tests/converters/quality/real_decoder.py): built,
opened, analysed and cut to its held-out text once per process, whichever of those files the process runs."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
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


class _Analyses(Mapping):
    """Each recipe of ``RECIPE_NAMES`` -> its analysis of the model, made the first time it is looked up: a job
    file's checks read their own recipe's, test_real_decoder.py every one."""

    def __init__(self, model_dir: Path) -> None:
        from converters.api import local_sources
        from converters.recipes.presets import RECIPE_NAMES

        self._model_dir, self._sources, self._names = model_dir, local_sources(model_dir.parent), list(RECIPE_NAMES)
        self._reports: dict[str, dict[str, Any]] = {}

    def __getitem__(self, name: str) -> dict[str, Any]:
        if name not in self._names:
            raise KeyError(name)
        if name not in self._reports:
            from converters.api import analyze
            from converters.recipes.presets import parse_compare_recipe

            self._reports[name] = analyze(str(self._model_dir), recipe=parse_compare_recipe(name, "recipe"),
                                          sources=self._sources)
        return self._reports[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


@pytest.fixture(scope="session")
def smollm_reports(smollm_model_dir) -> Mapping[str, dict[str, Any]]:
    """Each recipe of ``RECIPE_NAMES`` -> its analysis of the model (each made when a test first reads it)."""
    return _Analyses(smollm_model_dir)


@pytest.fixture(scope="session")
def smollm_recipe_figures(smollm_source, smollm_reports, smollm_texts):
    """Each recipe that converts something -> the quality of its emulated casts, all in one pass."""
    from tests.converters.quality.real_decoder import NOT_ELIGIBLE, recipe_figures

    return recipe_figures(smollm_source, smollm_reports, smollm_texts,
                          [name for name in smollm_reports if name not in NOT_ELIGIBLE])
