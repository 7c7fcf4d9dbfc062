"""How the suite is laid out for pytest-xdist: whole test files, the most expensive first, each test id unique.

``make test`` runs the suite with ``-n 3 --dist loadfile`` (pyproject's addopts): every test of a file runs in one
process, so a file's module-scoped fixtures (most of them convert a tiny model into several serving formats) run
once, not once in each process that xdist's plain ``load`` happened to send one of its tests to. loadfile hands out
files in collection order (``--no-loadscope-reorder``; xdist would otherwise order them by test count), so
:func:`heaviest_files_first` puts the files that took longest in a recorded run (``tests/file_seconds.json``) at the
front: started last, a long file would run alone while the other processes sit idle, and the wall would grow by it.

The record is a hint, not a contract: a file it does not know weighs :data:`UNKNOWN_TEST_SECONDS` per test, and
``pytest --record-file-seconds=tests/file_seconds.json`` writes a new one (seconds of setup, call and teardown
summed per file, all processes together). ``--record-file-cpu=PATH`` writes the CPU seconds of the same phases
(the test process and the child processes it waited for: servers, CLI runs, workers): on a shared machine the
wall follows the load, the CPU much less, so that is the figure to compare a change by.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import pytest

__all__ = ["FILE_SECONDS", "UNKNOWN_TEST_SECONDS", "CpuSeconds", "FileSeconds", "file_of", "heaviest_files_first",
           "load_file_seconds", "unique_ids"]

FILE_SECONDS = Path(__file__).with_name("file_seconds.json")

#: the weight per test of a file the record does not hold (a new file): about the suite's median test
UNKNOWN_TEST_SECONDS = 0.5


def file_of(nodeid: str) -> str:
    """The test file part of a node id (``tests/a/test_b.py::test_c[x]`` -> ``tests/a/test_b.py``)."""
    return nodeid.split("::", 1)[0]


def load_file_seconds(path: Path = FILE_SECONDS) -> dict[str, float]:
    """The recorded seconds per test file; empty when there is no record."""
    if not path.is_file():
        return {}
    return {str(name): float(seconds) for name, seconds in json.loads(path.read_text()).items()}


def heaviest_files_first(items: list[pytest.Item], seconds: Mapping[str, float]) -> list[pytest.Item]:
    """``items`` with whole files ordered by their recorded seconds, the largest first.

    The tests of a file keep their order and stay together (pytest's own ordering within a file, which groups
    tests by their fixtures' parameters, is kept); files of equal weight keep their collection order.
    """
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(file_of(item.nodeid), []).append(item)

    def weight(name: str) -> float:
        return seconds.get(name, UNKNOWN_TEST_SECONDS * len(files[name]))

    return [item for name in sorted(files, key=lambda name: -weight(name)) for item in files[name]]


def unique_ids(items: Iterable[pytest.Item]) -> list[str]:
    """Give items that share a node id their own, from the bracketed part of their name; the ids still shared.

    schemathesis names each operation's test ``test_api_conforms_to_its_schema[POST /v1/jobs]``, but under pytest 9
    all of them get the id ``...::test_api_conforms_to_its_schema``; xdist's loadfile keys its work by node id,
    so the operations would collapse into one test and the others would never run. pytest 9 keeps the id in
    ``Node._id`` (a ``NodeId``): the operation label goes into its params, as a parametrized test's would.
    """
    items = list(items)
    counts = Counter(item.nodeid for item in items)
    for item in items:
        if counts[item.nodeid] < 2 or "[" not in item.name or not item.name.endswith("]"):
            continue
        node_id = getattr(item, "_id", None)
        if node_id is None or getattr(node_id, "params", "") is not None:
            continue
        item._id = node_id.with_params(item.name.split("[", 1)[1][:-1])
    counts = Counter(item.nodeid for item in items)
    return sorted(nodeid for nodeid, count in counts.items() if count > 1)


def cpu_seconds_so_far() -> float:
    """User and system CPU seconds of this process and of the children it has waited for."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class CpuSeconds:
    """Gives each report of a test phase the CPU seconds the phase took, as ``report.cpu_seconds``.

    Registered in every process that runs tests: xdist sends a report's extra attributes to the controller with it.
    A child counts once it has been waited for (``subprocess.run``, ``Popen.wait``, a joined multiprocessing
    process), in the phase that waited for it: a server a module fixture stops counts in the file's last teardown.
    """

    def __init__(self) -> None:
        self.phase_start = cpu_seconds_so_far()

    def pytest_runtest_logstart(self) -> None:
        self.phase_start = cpu_seconds_so_far()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self):
        outcome = yield
        now = cpu_seconds_so_far()
        outcome.get_result().cpu_seconds = now - self.phase_start
        self.phase_start = now


class FileSeconds:
    """Sums each test file's setup, call and teardown seconds over a run and writes them as JSON at its end.

    ``clock``: the report attribute summed, ``duration`` (wall) or ``cpu_seconds`` (:class:`CpuSeconds`).
    Registered in the process that reports (xdist's controller, or the only one): every process's reports reach
    it there.
    """

    def __init__(self, path: Path, clock: str = "duration") -> None:
        self.path = path
        self.clock = clock
        self.seconds: Counter[str] = Counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += getattr(report, self.clock, 0.0)

    def pytest_sessionfinish(self) -> None:
        ordered = dict(sorted(((name, round(value, 1)) for name, value in self.seconds.items()),
                              key=lambda pair: (-pair[1], pair[0])))
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(ordered, indent=1) + "\n")
        partial.replace(self.path)
