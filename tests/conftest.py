import os
from pathlib import Path

import pytest

os.environ.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from tests.models import TINY_CONFIGS, save_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def models_root(tmp_path_factory) -> Path:
    """An allowed local root holding every tiny test model, saved once per session."""
    root = tmp_path_factory.mktemp("models")
    for name in TINY_CONFIGS:
        save_tiny_model(name, root / name)
    return root


@pytest.fixture(scope="session")
def sources(models_root):
    from converters.model.sources import ModelSourceOptions

    return ModelSourceOptions(allowed_roots=(models_root,), offline=True)
