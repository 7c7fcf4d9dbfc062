"""Start-up settings: `fp8forge serve` and `fp8forge worker` refuse a bad or misspelt FP8FORGE_* variable."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from service.config import SettingsError, load_settings
from tests.service_helpers import fp8forge_command, free_port


def _run(command: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.upper().startswith("FP8FORGE_")}
    clean.update(FP8FORGE_DATA_DIR=str(tmp_path / "data"), **env)
    args = ["--port", str(free_port()), "--workers", "0"] if command == "serve" else []
    # A process that did start would serve until the timeout: the test then fails instead of hanging.
    return subprocess.run([*fp8forge_command(), command, *args], env=clean, capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parents[3])


@pytest.mark.parametrize("command", ["serve", "worker"])
def test_an_invalid_value_exits_2_naming_the_variable(tmp_path: Path, command: str) -> None:
    done = _run(command, tmp_path, FP8FORGE_HEARTBEAT_INTERVAL_S="soon")
    assert done.returncode == 2, done.stderr
    assert "FP8FORGE_HEARTBEAT_INTERVAL_S" in done.stderr
    assert not (tmp_path / "data").exists()  # nothing was started or created


def test_a_misspelt_variable_exits_2_listing_the_valid_names(tmp_path: Path) -> None:
    done = _run("serve", tmp_path, FP8FORGE_HEARTBEAT_INTERVAL="0.5")
    assert done.returncode == 2, done.stderr
    assert "FP8FORGE_HEARTBEAT_INTERVAL" in done.stderr and "FP8FORGE_HEARTBEAT_INTERVAL_S" in done.stderr
    assert "FP8FORGE_DATABASE_URL" in done.stderr


def test_load_settings_accepts_every_documented_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.upper().startswith("FP8FORGE_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("FP8FORGE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("FP8FORGE_CANCEL_GRACE_S", "0.5")
    assert load_settings().cancel_grace_s == 0.5
    monkeypatch.setenv("fp8forge_workerz", "2")
    with pytest.raises(SettingsError, match="fp8forge_workerz"):
        load_settings()
