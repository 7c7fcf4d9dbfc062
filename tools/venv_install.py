"""Install into a venv with uv where uv can honour this machine's pip configuration, with pip otherwise.

Usage: ``python3 tools/venv_install.py VENV [-q] [--no-deps] REQUIREMENT...`` (pip's install arguments).

uv installs what pip would, from the same places: pip's own configuration (``pip config list``: files and PIP_*
variables) gives its index, extra indexes, find-links, constraints, certificate bundle and timeout, and uv weighs
every index as pip does (``--index-strategy unsafe-best-match``; uv's default takes a package from the first index
that has it). It resolves in parallel and links from its cache, where pip fetched index pages one at a time and
unzipped every wheel: docs/benchmarks/ has the seconds. pip installs instead, saying why, where a pip setting has
no uv translation here, where uv cannot be installed, or where the uv run fails. Neither byte-compiles
(the Makefile compiles what the service imports once).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

UV = "uv==0.13.9"
#: pip settings with a uv option that takes one value per whitespace-separated item
LIST_OPTIONS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
                "constraint": "--constraint", "trusted-host": "--allow-insecure-host"}
#: pip settings uv reads from the environment
ENV_OPTIONS = {"cert": "SSL_CERT_FILE", "timeout": "UV_HTTP_TIMEOUT", "default-timeout": "UV_HTTP_TIMEOUT"}
#: pip settings that change nothing of what is installed
IGNORED = {"disable-pip-version-check", "no-color", "progress-bar", "quiet", "verbose", "no-compile",
           "root-user-action", "no-input", "retries", "config-file"}
#: pip's sections from weakest to strongest (a PIP_* variable is ":env:")
SECTIONS = ("global", "install", ":env:")


def pip_settings(python: str) -> dict[str, str]:
    """pip's effective settings for ``pip install``: key -> value, the strongest section winning."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True)
    found: dict[str, tuple[int, str]] = {}
    for line in listed.stdout.splitlines():
        name, _, quoted = line.partition("=")
        section, _, key = name.rpartition(".")
        if section not in SECTIONS:
            continue
        rank = SECTIONS.index(section)
        if key not in found or found[key][0] <= rank:
            found[key] = (rank, " ".join(shlex.split(quoted)))
    return {key: value for key, (_, value) in found.items()}


def uv_options(settings: dict[str, str]) -> tuple[list[str], dict[str, str]] | str:
    """uv's options and environment for pip's ``settings``; a reason instead where one has no translation."""
    options, environment = ["--index-strategy", "unsafe-best-match"], {}
    for key, value in settings.items():
        if key in LIST_OPTIONS:
            options += [part for item in value.split() for part in (LIST_OPTIONS[key], item)]
        elif key in ENV_OPTIONS:
            environment[ENV_OPTIONS[key]] = value
        elif key == "no-index" and value.lower() in ("1", "true", "yes", "on"):
            options.append("--no-index")
        elif key not in IGNORED:
            return f"pip's setting {key}={value!r} has no uv translation here"
    return options, environment


def ensure_uv(venv: Path, python: str) -> Path | str:
    """The venv's uv, installed with its pip first where missing; a reason where that fails."""
    uv = venv / "bin" / "uv"
    if not uv.exists():
        done = subprocess.run([python, "-m", "pip", "install", "-q", UV], capture_output=True, text=True)
        if done.returncode or not uv.exists():
            return f"pip could not install {UV}: {done.stderr.strip()[-500:]}"
    return uv


def uv_install(venv: Path, arguments: list[str]) -> str | None:
    """Install ``arguments`` with uv; None when it did, else why it did not."""
    python = str(venv / "bin" / "python")
    try:
        translated = uv_options(pip_settings(python))
    except (OSError, subprocess.CalledProcessError) as error:
        return f"pip could not list its configuration: {error}"
    if isinstance(translated, str):
        return translated
    uv = ensure_uv(venv, python)
    if isinstance(uv, str):
        return uv
    options, environment = translated
    done = subprocess.run([str(uv), "pip", "install", "--python", python, *options, *arguments],
                          env={**os.environ, **environment})
    return None if done.returncode == 0 else f"uv exited {done.returncode}"


def install(venv: Path, arguments: list[str]) -> int:
    why_not = uv_install(venv, arguments)
    if why_not is None:
        return 0
    print(f"venv_install: pip installs instead of uv ({why_not})", file=sys.stderr, flush=True)
    return subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-compile", *arguments]).returncode


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    raise SystemExit(install(Path(sys.argv[1]), sys.argv[2:]))
