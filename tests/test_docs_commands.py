"""The command sessions of README.md and docs/*.md, run as written: a doc that drifts from the code fails here.

Every fenced ```sh block is a session a reader would paste into a shell at the repository root, with the venv
installed. Each runs in a bash of its own (``-e -o pipefail``: the first failing command fails the block) in a
fresh working directory that holds a link to this venv as ``.venv``, so ``./data``, downloads and ``--out``
directories land in the test's temporary directory. The blocks of one document run in order, in one directory.

Only the address changes: ``localhost:8000`` and ``127.0.0.1:8000`` become a free loopback port, a started
``fp8forge serve`` gets that port, and ``--host 0.0.0.0`` becomes ``--host 127.0.0.1``. The environment holds no
``FP8FORGE_*`` variable, the hub is offline (the docs use the built-in ``demo/tiny-llama``) and the CLI's demo
cache is the test's. A block that starts a server stops it when it ends (its background jobs get SIGTERM).

Markers, an HTML comment on the line before a block:
- ``<!-- needs: make serve -->``: the block talks to the server ``make serve`` runs; the test starts it (what the
  Makefile runs, ``FP8FORGE_AUTH_DISABLED=1 .venv/bin/fp8forge serve``, in the block's directory) and stops it.
- ``<!-- not-run: REASON -->``: the block cannot run here (a GPU, Docker, PostgreSQL and an object store, the
  whole test suite); the test lists these with their reasons, and their number is pinned below, so a new one is
  a decision, not an accident.
A usage synopsis (``fp8forge convert MODEL --out DIR [...]``) is not a session: it is fenced as ``text``.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.service_helpers import free_port, wait_for

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK_TIMEOUT_S = 240

#: blocks marked not-run, per document: change these only together with the markers
NOT_RUN = {"README.md": 1, "docs/benchmarks.md": 1, "docs/deployment.md": 1, "docs/service.md": 2, "docs/quality.md": 3}

#: where the sessions may write (.venv is the test's link): out/ and the server's data/, both in .gitignore
OUTPUT_DIRS = (".venv", "out", "data")

_MARKER = re.compile(r"^<!--\s*(not-run|needs):\s*(.*?)\s*-->$")


@dataclass(frozen=True)
class Block:
    doc: str  #: path relative to the repository root
    line: int  #: of the opening fence
    text: str
    not_run: str | None  #: the reason given by a not-run marker
    needs: str | None  #: "make serve" for a block that expects that server running

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"


def shell_blocks() -> list[Block]:
    """Every ```sh block of the docs, with the marker on the line before it (if any)."""
    found = []
    for path in DOCS:
        lines = path.read_text(encoding="utf-8").splitlines()
        index = 0
        while index < len(lines):
            if lines[index].strip() == "```sh":
                end = next(i for i in range(index + 1, len(lines)) if lines[i].strip() == "```")
                before = next((lines[i].strip() for i in range(index - 1, -1, -1) if lines[i].strip()), "")
                marker = _MARKER.match(before)
                kind, value = marker.groups() if marker else (None, None)
                found.append(Block(doc=path.relative_to(ROOT).as_posix(), line=index + 1,
                                   text="\n".join(lines[index + 1:end]) + "\n",
                                   not_run=value if kind == "not-run" else None,
                                   needs=value if kind == "needs" else None))
                index = end
            index += 1
    return found


BLOCKS = shell_blocks()
RUNNABLE_DOCS = sorted({block.doc for block in BLOCKS if block.not_run is None})


def test_each_shell_block_runs_or_is_marked_with_a_reason(capsys):
    markers = [(path.relative_to(ROOT).as_posix(), number + 1, line.strip())
               for path in DOCS for number, line in enumerate(path.read_text(encoding="utf-8").splitlines())
               if line.strip().startswith("<!--") and ("not-run" in line or "needs:" in line)]
    marked = {(block.doc, block.line) for block in BLOCKS if block.not_run is not None or block.needs is not None}
    for doc, number, line in markers:  # each marker stands right before a block (blank lines between are fine)
        assert _MARKER.match(line), f"{doc}:{number}: malformed marker {line!r}"
        assert any(d == doc and number < n <= number + 3 for d, n in marked), f"{doc}:{number}: no block follows"
    not_run = [block for block in BLOCKS if block.not_run is not None]
    with capsys.disabled():
        print(f"\n{len(BLOCKS)} shell blocks in {len(DOCS)} documents; {len(not_run)} not run here:")
        for block in not_run:
            print(f"  {block}: {block.not_run}")
    assert all(block.not_run for block in not_run), "a not-run marker must say why"
    assert all(block.needs in (None, "make serve") for block in BLOCKS)
    counts = {doc: sum(1 for block in not_run if block.doc == doc) for doc in {block.doc for block in not_run}}
    assert counts == NOT_RUN
    assert len(BLOCKS) - len(not_run) >= 4  # the sessions the next test runs


def substituted(text: str, port: int) -> str:
    """The block with the test server's address in place of the docs' (nothing else changes)."""
    text = re.sub(r"\b(?:localhost|127\.0\.0\.1):8000\b", f"127.0.0.1:{port}", text)
    text = text.replace("--host 0.0.0.0", "--host 127.0.0.1")
    return re.sub(r"(fp8forge serve)\b(?![^\n]*--port)", rf"\1 --port {port}", text)


def session_env(workdir: Path) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("FP8FORGE_")}
    # PYTHONDONTWRITEBYTECODE as the run has it (the Makefile empties it): forced to 1, each of the sessions' CLI,
    # server and worker processes compiled the project's modules again (about 0.6 s of CPU each)
    env.update(XDG_CACHE_HOME=str(workdir.parent / "cache"), HF_HUB_OFFLINE="1",
               TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
    return env


def _stop_group(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM the process group (a server's graceful stop), SIGKILL whatever is left after ``grace_s``."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def make_serve(workdir: Path, env: dict[str, str], port: int) -> Iterator[None]:
    """What `make serve` runs, in ``workdir``, on ``port``."""
    log = workdir.parent / f"make-serve-{port}.log"
    with log.open("ab") as out:
        proc = subprocess.Popen([".venv/bin/fp8forge", "serve", "--port", str(port)], cwd=workdir, stdout=out,
                                stderr=subprocess.STDOUT, env={**env, "FP8FORGE_AUTH_DISABLED": "1"},
                                start_new_session=True)
    def healthy(probe: httpx.Client) -> bool:
        assert proc.poll() is None, f"fp8forge serve exited:\n{log.read_text()[-3000:]}"
        with contextlib.suppress(httpx.TransportError):
            return probe.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        return False

    try:
        # one client for every poll: httpx.get builds one (and its SSL context) per call, about 25 ms of CPU each
        with httpx.Client(timeout=2) as probe:
            wait_for(lambda: healthy(probe), timeout=60, interval=0.2, what="`make serve` to answer /healthz")
        yield
    finally:
        _stop_group(proc)


def run_block(block: Block, workdir: Path, env: dict[str, str], port: int) -> subprocess.CompletedProcess:
    # a server the block started in the background stops with the block, as it would with the reader's shell
    stop_jobs = "trap 'status=$?; kill $(jobs -p) 2>/dev/null || true; wait; exit $status' EXIT\n"
    script = stop_jobs + substituted(block.text, port)
    proc = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", script], cwd=workdir, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        _stop_group(proc, grace_s=5)
        output = (proc.stdout.read() if proc.stdout else "") + f"\n[timed out after {BLOCK_TIMEOUT_S} s]"
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing of the block outlives it
            os.killpg(proc.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(proc.args, proc.returncode, output)


@pytest.mark.slow  # every command a fresh CLI process (torch and transformers imports), servers, conversions
@pytest.mark.parametrize("doc", RUNNABLE_DOCS)
def test_the_docs_sessions_run_as_written(doc, tmp_path):
    workdir = tmp_path / "session"
    workdir.mkdir()
    (workdir / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    env = session_env(workdir)
    for block in (block for block in BLOCKS if block.doc == doc and block.not_run is None):
        port = free_port()
        started = time.monotonic()
        with make_serve(workdir, env, port) if block.needs == "make serve" else contextlib.nullcontext():
            done = run_block(block, workdir, env, port)
        print(f"{block}: exit {done.returncode} in {time.monotonic() - started:.1f} s")
        assert done.returncode == 0, f"{block} failed (exit {done.returncode}):\n{done.stdout[-6000:]}"
    # a reader runs these at the repository root: what they write goes under out/ (or the server's data/), both
    # ignored by git, never beside the sources
    left = sorted(path.name for path in workdir.iterdir() if path.name not in OUTPUT_DIRS)
    assert left == [], f"{doc}'s commands leave {left} in the directory they run in; write under out/ instead"


def test_the_readme_is_read_in_two_minutes_with_a_rest_session_near_its_top():
    """README = what it is, the two set-up commands, `make install`, a quickstart with a REST session in its first
    80 lines, the loads-in table and links; everything else lives in docs/ (issue #37, item 6)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) < 200, f"README.md has {len(lines)} lines; move detail into docs/*.md and link it"
    readme = [block for block in BLOCKS if block.doc == "README.md"]
    assert readme[0].not_run and readme[0].text.split()[:2] == ["make", "serve"] and "make test" in readme[0].text
    assert "`make install`" in "\n".join(lines)
    rest = next(block for block in readme if block.needs == "make serve" and "/v1/jobs" in block.text)
    assert rest.line <= 80, f"README's REST session starts at line {rest.line}; bring it within the first 80"


def test_every_relative_link_of_the_docs_names_a_file_that_exists():
    documents = [*DOCS, *sorted((ROOT / "docs" / "benchmarks").glob("*.md"))]
    broken = []
    for path in documents:
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue  # a web address, or a heading of the same page
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert broken == [], f"links to files that do not exist: {broken}"
