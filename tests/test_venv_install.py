"""tools/venv_install.py: pip's configuration, read by pip itself, becomes uv's options; a setting uv cannot honour
sends the install to pip."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("venv_install", ROOT / "tools" / "venv_install.py")
venv_install = importlib.util.module_from_spec(spec)
spec.loader.exec_module(venv_install)


@pytest.fixture
def pip_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Only this test's pip configuration: a config file of its own, no PIP_* variable of the machine's."""
    for name in [name for name in os.environ if name.startswith("PIP_")]:
        monkeypatch.delenv(name)
    config = tmp_path / "pip.conf"
    monkeypatch.setenv("PIP_CONFIG_FILE", str(config))
    return config


def test_pip_reads_its_sections_and_variables_strongest_last(pip_config: Path, monkeypatch) -> None:
    pip_config.write_text("[global]\nfind-links = /global-wheels\nconstraint = /etc/caps.txt\n"
                          "extra-index-url = file:///one/simple file:///two/simple\n"
                          "[install]\nfind-links = /install-wheels\n")
    monkeypatch.setenv("PIP_DEFAULT_TIMEOUT", "180")
    settings = venv_install.pip_settings(sys.executable)
    assert settings["find-links"] == "/install-wheels"  # pip install's own section over [global]
    assert settings["constraint"] == "/etc/caps.txt"
    assert settings["extra-index-url"] == "file:///one/simple file:///two/simple"
    assert settings["default-timeout"] == "180"
    monkeypatch.setenv("PIP_FIND_LINKS", "/env-wheels")
    assert venv_install.pip_settings(sys.executable)["find-links"] == "/env-wheels"  # a variable over the files


def test_every_index_and_constraint_reaches_uv(pip_config: Path) -> None:
    options, environment = venv_install.uv_options({
        "find-links": "/wheels", "constraint": "/etc/caps.txt", "extra-index-url": "file:///one file:///two",
        "cert": "/etc/ssl/ca.crt", "default-timeout": "180", "disable-pip-version-check": "1"})
    pairs = list(zip(options[::2], options[1::2], strict=True))
    assert pairs == [("--index-strategy", "unsafe-best-match"), ("--find-links", "/wheels"),
                     ("--constraint", "/etc/caps.txt"), ("--extra-index-url", "file:///one"),
                     ("--extra-index-url", "file:///two")]
    assert environment == {"SSL_CERT_FILE": "/etc/ssl/ca.crt", "UV_HTTP_TIMEOUT": "180"}


def test_a_setting_without_a_translation_leaves_the_install_to_pip(pip_config: Path, monkeypatch) -> None:
    monkeypatch.setenv("PIP_PRE", "1")  # pre-releases: a choice uv would make otherwise if it were dropped
    reason = venv_install.uv_options(venv_install.pip_settings(sys.executable))
    assert reason == "pip's setting pre='1' has no uv translation here"
