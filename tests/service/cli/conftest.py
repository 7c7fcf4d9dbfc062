"""Fixtures of the CLI tests."""

import pytest


@pytest.fixture
def demo_cache(tmp_path_factory, monkeypatch):
    """One user cache per session (``XDG_CACHE_HOME``), so the CLI builds the demo model once."""
    cache = tmp_path_factory.getbasetemp() / "user-cache"
    cache.mkdir(exist_ok=True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache
