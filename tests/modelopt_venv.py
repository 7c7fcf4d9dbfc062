"""Where nvidia-modelopt's own venv is (``make modelopt-venv`` builds it), and why it cannot run here.

Tests that run ModelOpt's code and benchmarks/bench_serving_formats.py read the path from here. ModelOpt pins its own
torch and transformers, so it is never a project dependency: the tests call its python through a subprocess.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELOPT_VENV = ROOT / os.environ.get("MODELOPT_VENV", "build/modelopt-venv")  # a relative path is the repository's
MODELOPT_PYTHON = MODELOPT_VENV / "bin" / "python"
#: the Makefile's stamp, written once `import modelopt` worked (a build that failed half-way leaves bin/python)
MODELOPT_STAMP = MODELOPT_VENV / ".installed"
#: how long a test waits for `make test`'s background build to end before it skips
BUILD_WAIT_S = 1800


def modelopt_missing() -> str | None:
    """Why ModelOpt's venv cannot run here, or None. Under `make test` the venv builds while the suite runs
    (MODELOPT_BUILD_LOG names its log, and ``<log>.done`` appears when the build has ended): wait for it."""
    log = os.environ.get("MODELOPT_BUILD_LOG")
    if log and not MODELOPT_STAMP.exists():
        deadline = time.monotonic() + BUILD_WAIT_S
        while not Path(f"{log}.done").exists() and time.monotonic() < deadline:
            time.sleep(2)
    if MODELOPT_PYTHON.exists() and MODELOPT_STAMP.exists():
        return None
    built = f"its build failed or is still running: see {log}" if log else "`make modelopt-venv` builds it"
    return f"nvidia-modelopt is not installed at {MODELOPT_VENV}: {built}"


def modelopt_python() -> Path:
    """ModelOpt's python, or the calling test skips with the reason it is missing."""
    import pytest

    reason = modelopt_missing()
    if reason:
        pytest.skip(reason)
    return MODELOPT_PYTHON
