"""The engine tests' vLLM process: one for the whole session (tests.engines.engine.one_driver)."""

from __future__ import annotations

import pytest

from tests.engines.engine import one_driver


@pytest.fixture(scope="session", autouse=True)
def one_vllm_process(tmp_path_factory):
    """Every module's requests go to one vllm_driver.py process, started by the first; its stderr in this log."""
    with one_driver(tmp_path_factory.getbasetemp() / "vllm-driver.log"):
        yield
